"""Rounding of Winograd F(m×m, 3×3) for other interpolation points than Lavin's 0, ±1, ±2, and for other tile sizes,
simulated in float32 (kernels/README.md, "Rounding per path": tried and dropped). The Toom-Cook matrices are built
exactly (fractions) for each point set; 4,000 2-D tiles of 64 channels, inputs |N(0, 1)| half zero, He-scaled weights;
the transforms and the channel sum in float32; printed: the relative error against float64, and that over a float32
direct sum's.

    python benchmarks/winograd_points.py             # F(4×4, 3×3), the point sets below
    python benchmarks/winograd_points.py --tile 3    # F(3×3, 3×3): five points; --tile 2: F(2×2)'s 0, ±1
"""

from __future__ import annotations

from fractions import Fraction as F

import numpy as np

R = 3  # F(m, 3): m + 2 points, the m + 1 finite ones given, plus infinity (m, the tile, from the points)


def _poly(roots: list[F]) -> list[F]:
    """Coefficients (lowest power first) of the product of (x − r)."""
    c = [F(1)]
    for q in roots:
        new = [F(0)] * (len(c) + 1)
        for i, a in enumerate(c):
            new[i + 1] += a
            new[i] -= a * q
        c = new
    return c


def matrices(points) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Aᵀ (4 × 6), G (6 × 3), Bᵀ (6 × 6) of the Toom-Cook algorithm on ``points`` and infinity, exact."""
    pts = [F(p) for p in points]
    tile = len(pts) - 1
    at = [[p**i for p in pts] + [F(1) if i == tile - 1 else F(0)] for i in range(tile)]
    g = []
    for k, p in enumerate(pts):
        norm = F(1)
        for q in pts[:k] + pts[k + 1:]:
            norm *= p - q
        g.append([p**j / norm for j in range(R)])
    g.append([F(0), F(0), F(1)])
    bt = [_poly(pts[:k] + pts[k + 1:]) + [F(0)] for k in range(len(pts))] + [_poly(pts)]

    def array(rows):
        return np.array([[float(v) for v in row] for row in rows])

    return array(at), array(g), array(bt)


def check(at: np.ndarray, g: np.ndarray, bt: np.ndarray) -> float:
    """Max error of the 1-D algorithm in float64 against the direct correlation (the matrices are right)."""
    rng = np.random.default_rng(0)
    tile = at.shape[0]
    d, w = rng.standard_normal(tile + 2), rng.standard_normal(3)
    want = np.array([d[i:i + 3] @ w for i in range(tile)])
    return float(np.abs(at @ ((g @ w) * (bt @ d)) - want).max())


def errors(at: np.ndarray, g: np.ndarray, bt: np.ndarray, channels: int = 64, tiles: int = 4000) -> tuple[float, float]:
    """(Winograd's, a float32 direct sum's) relative error against float64 on the same tiles."""
    rng = np.random.default_rng(0)
    f32 = np.float32
    tile = at.shape[0]
    side = tile + 2
    d = np.abs(rng.standard_normal((tiles, channels, side, side))) * (rng.random((tiles, channels, side, side)) > 0.5)
    w = rng.standard_normal((channels, 3, 3)) * np.sqrt(2 / (9 * channels))
    want = np.zeros((tiles, tile, tile))
    for a in range(3):
        for b in range(3):
            want += np.einsum("tcij,c->tij", d[:, :, a:a + tile, b:b + tile], w[:, a, b])
    d32, w32 = d.astype(f32), w.astype(f32)
    at32, g32, bt32 = at.astype(f32), g.astype(f32), bt.astype(f32)
    u = np.einsum("ij,cjk,lk->cil", g32, w32, g32).astype(f32)
    v = np.einsum("ij,tcjk,lk->tcil", bt32, d32, bt32).astype(f32)
    m = np.einsum("tcil,cil->til", v, u).astype(f32)  # the channel sum in float32
    y = np.einsum("ij,tjk,lk->til", at32, m, at32).astype(f32)
    columns = np.stack([d32[:, :, a:a + tile, b:b + tile] for a in range(3) for b in range(3)], 2)
    direct = np.einsum("tcsij,cs->tij", columns, w32.reshape(channels, 9)).astype(f32)
    norm = np.linalg.norm(want)
    return float(np.linalg.norm(y - want) / norm), float(np.linalg.norm(direct - want) / norm)


POINT_SETS = {
    4: {
        "0, ±1, ±2 (Lavin)": [0, 1, -1, 2, -2],
        "0, ±1, ±1/2": [0, 1, -1, F(1, 2), F(-1, 2)],
        "0, ±1, 1/2, −2": [0, 1, -1, F(1, 2), -2],
        "0, ±1, 2, −1/2": [0, 1, -1, 2, F(-1, 2)],
        "0, ±1/2, ±2": [0, F(1, 2), F(-1, 2), 2, -2],
        "0, ±1, ±3/2": [0, 1, -1, F(3, 2), F(-3, 2)],
        "0, ±1, ±2/3": [0, 1, -1, F(2, 3), F(-2, 3)],
    },
    3: {
        "0, ±1, 2": [0, 1, -1, 2],
        "0, ±1, −2": [0, 1, -1, -2],
        "0, ±1, 1/2": [0, 1, -1, F(1, 2)],
        "0, ±1, −1/2": [0, 1, -1, F(-1, 2)],
        "0, 1, ±1/2": [0, 1, F(1, 2), F(-1, 2)],
        "0, ±1/2, 2": [0, F(1, 2), F(-1, 2), 2],
    },
    2: {"0, ±1 (F(2×2))": [0, 1, -1]},
}
"""Finite points per tile size m (m + 1 of them; infinity is the last)."""


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tile", type=int, choices=sorted(POINT_SETS), default=4, help="m of F(m×m, 3×3)")
    for name, points in POINT_SETS[parser.parse_args().tile].items():
        at, g, bt = matrices(points)
        ours, direct = errors(at, g, bt)
        print(f"{name:20s} check {check(at, g, bt):.1e}  error {ours:.2e}  float32 direct {direct:.2e}  "
              f"ratio {ours / direct:.1f}×  largest |Aᵀ| {abs(at).max():.3g} |Bᵀ| {abs(bt).max():.3g} "
              f"|G| {abs(g).max():.3g}")

if __name__ == "__main__":
    main()
