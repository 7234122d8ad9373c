"""The README example runs as written and trains (its loss drops)."""

import importlib.util
import pathlib
import sys

from fscale.testing import run_spmd

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "train_gpt_data_parallel.py"


def _load():
    spec = importlib.util.spec_from_file_location("train_gpt_data_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so its functions pickle by reference for the ranks
    spec.loader.exec_module(module)
    return module


def test_readme_example_is_the_example_file():
    readme = (EXAMPLE.parent.parent / "README.md").read_text()
    body = EXAMPLE.read_text().split('"""\n\n', 1)[1]
    assert body in readme


def test_readme_example_trains_on_two_ranks():
    losses = run_spmd(_load().main, 2, timeout=300)
    assert losses[0] == losses[1]  # the metric is the global mean, equal on every rank
    assert losses[0] < 3.5  # from ~5.5 (log 256) at the start
