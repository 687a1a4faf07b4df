"""Images per second of the image-folder loader alone: decode + RandomResizedCrop + flip + normalize.

    python benchmarks/bench_loader.py [--images 96] [--batch-size 32] [--workers 1,2,4] [--repeat 3]

Writes ``--images`` JPEGs of 500×375 (ImageNet's most common size, quality 90) into a temporary
folder of 4 classes, then times ``ImageFolderSource.fill`` over whole batches of the training split
for each decoding thread count, the counts alternating round by round; prints the median of
``--repeat`` rounds. Compare with a training step's images/s (``engine bench`` / ``engine train``)
to see which one is the bottleneck.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_folder(root: str, images: int, size: tuple[int, int] = (500, 375)) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)  # smooth, photo-like content
    for i in range(images):
        folder = os.path.join(root, f"class{i % 4}")
        os.makedirs(folder, exist_ok=True)
        noise = rng.integers(0, 32, (size[1], size[0], 3), dtype=np.uint8)
        picture = Image.fromarray(base).resize(size, Image.BILINEAR)
        pixels = np.asarray(picture, dtype=np.uint8) // 2 + noise
        Image.fromarray(pixels).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)


def main() -> int:
    from engine.data.imagefolder import ImageFolderSource, find_classes, make_samples

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="loader-bench-") as root:
        write_folder(root, args.images)
        paths, labels = make_samples(root, find_classes(root))
        sources = {w: ImageFolderSource(np.array(paths), np.array(labels, np.int64), args.image_size,
                                        args.batch_size, train=True, workers=w) for w in counts}
        x = np.empty((args.batch_size, 3, args.image_size, args.image_size), np.float32)
        y = np.empty(args.batch_size, np.int64)
        batches = len(paths) // args.batch_size
        rates: dict[int, list[float]] = {w: [] for w in counts}
        for round_ in range(args.repeat + 1):  # the first round warms the page cache and the pools
            for w in counts:
                start = time.perf_counter()
                for index in range(batches):
                    sources[w].fill(round_, index, x, y)
                if round_:
                    rates[w].append(batches * args.batch_size / (time.perf_counter() - start))
        for source in sources.values():
            source.close()
    print(f"image-folder loader, {args.images} JPEGs 500x375 -> {args.image_size}x{args.image_size}, "
          f"batch {args.batch_size}, {os.cpu_count()} cores; median of {args.repeat} rounds")
    print("| decoding threads | images/s |")
    print("|---:|---:|")
    for w in counts:
        print(f"| {w} | {statistics.median(rates[w]):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
