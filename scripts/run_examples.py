"""Run every entry of every examples/*.yaml on the bundled demo model with few prompts, and save each.

    python scripts/run_examples.py [--out DIR] [--n 4]

Every operation the docs show has an example file, so this is one small run of each: CI runs it in a fresh venv
with `pip install -e .` alone (no extras), where a missing dependency shows as a failure, and the tests run it
(tests/conftest.py `example_runs`) to read the saved folders and pages. The tuned-lens entries get translators
trained here (a few steps); the Jacobian lens is fitted by its own example and then read by the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PROBING_N = 40  # probes need train, validation and test rows


def run_examples(root: Path, n: int = 4, quiet: bool = True) -> dict[tuple[str, str], Path]:
    """{(file, entry): saved folder} for every example entry, run on the demo model with at most n prompts."""
    import entoscope as es
    from entoscope.config import build_operation, load_experiments

    root = Path(root)
    model = es.load_model("demo")
    lens = es.TunedLens.for_model(model)
    lens.fit(model, es.tasks.ioi(n=8, seed=1), steps=5, quiet=True)
    lens.save(root / "translators")
    os.environ["TUNED_LENS"] = str(root / "translators")
    os.environ["JACOBIAN_LENS"] = str(root / "jacobian")  # examples/jacobian_lens.yaml fits it, then reads it
    done = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for name, entry in load_experiments(path).items():
            op, spec = build_operation(entry, where=name)
            cap = PROBING_N if op.name == "probing" else n
            data = spec.model_copy(update={"n": min(spec.n or cap, cap)}) if spec is not None else None
            result = op.run(model, data, quiet=True)
            done[(path.name, name)] = result.save(root / path.stem / name)
            if not quiet:
                print(f"{path.name}: {name} ({op.name}) -> {done[(path.name, name)]}", flush=True)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="where the runs are saved (default: a temporary folder, removed)")
    parser.add_argument("--n", type=int, default=4, help="prompts per run (probing: %d)" % PROBING_N)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        done = run_examples(Path(args.out or tmp), n=args.n, quiet=False)
    operations = {folder.parent.name for folder in done.values()}
    print(f"{len(done)} example entries ran, from {len(operations)} example files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
