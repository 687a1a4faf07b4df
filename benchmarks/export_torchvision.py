"""Export torchvision's ResNet-18 or MobileNetV2 weights as a safetensors state_dict for ``engine train --weights``.

    pip install -e '.[test]'   # torch 2.13.0 and torchvision 0.28.0, CPU builds
    python benchmarks/export_torchvision.py resnet18 resnet18.safetensors       # ImageNet weights, downloaded once
    engine train --model resnet18 --variant imagenet --weights resnet18.safetensors --data imagefolder:DIR

The engine's parameter names, shapes and layouts are torchvision's (``--variant imagenet`` is its exact model),
so the file loads one to one; with another class count ``engine train`` draws a fresh classifier and says so.

Why a script and not three lines of torch: with the test extra's torch 2.13.0+cpu, ``import torchvision``
fails ("operator torchvision::nms does not exist"): its ``__init__`` registers C++ operators built against
another torch. The models are pure Python; ``import_torchvision`` imports them without running that
``__init__`` (``tests/conftest.py`` uses it too). ``--weights none`` exports torchvision's own random
initialisation (seeded), which needs no download: what the test of this script uses.

Weights come through torchvision's ``load_state_dict_from_url`` (``weights_only=True``: no pickled code runs);
the file is written to a temporary name and renamed, so a failed export leaves nothing half written.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types

MODELS = {"resnet18": "resnet18", "mobilenetv2": "mobilenet_v2"}  # engine name -> torchvision function


def import_torchvision() -> types.ModuleType:
    """torchvision's pure-Python parts (models, transforms, datasets.folder) without its C++ operators.

    Registers the package path in ``sys.modules`` without running torchvision's ``__init__`` (which loads
    the C++ operators), so the pure-Python submodules import. ModuleNotFoundError when it is not installed.
    """
    if "torchvision" not in sys.modules:
        spec = importlib.util.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("torchvision is not installed: pip install -e '.[test]'")
        package = types.ModuleType("torchvision")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        package.__file__ = spec.origin
        sys.modules["torchvision"] = package
    import torchvision.datasets.folder  # noqa: F401
    import torchvision.models  # noqa: F401
    import torchvision.transforms  # noqa: F401
    import torchvision.transforms.functional  # noqa: F401

    return sys.modules["torchvision"]


def export(model: str, output: str, weights: str = "DEFAULT", seed: int = 0) -> int:
    """Write ``model``'s torchvision state_dict to ``output`` (safetensors); returns the tensor count."""
    import torch
    from safetensors.torch import save_file

    torchvision = import_torchvision()
    torch.manual_seed(seed)
    network = getattr(torchvision.models, MODELS[model])(weights=None if weights.lower() == "none" else weights)
    state = {name: tensor.detach().contiguous() for name, tensor in network.state_dict().items()}
    temporary = f"{output}.part"
    try:
        save_file(state, temporary)
        os.replace(temporary, output)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return len(state)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("output", help="the .safetensors file to write")
    parser.add_argument("--weights", default="DEFAULT",
                        help="torchvision's weights name (DEFAULT, IMAGENET1K_V1, ...), or none: its random init")
    parser.add_argument("--seed", type=int, default=0, help="with --weights none: torch's seed")
    args = parser.parse_args(argv)
    try:
        count = export(args.model, args.output, args.weights, args.seed)
    except (ModuleNotFoundError, OSError, ValueError, KeyError) as exc:  # not installed, offline, a bad name
        print(f"error: {args.model}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {count} tensors of torchvision's {MODELS[args.model]} "
          f"({'random initialisation, seed ' + str(args.seed) if args.weights.lower() == 'none' else args.weights})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
