"""The documentation's examples run: every docstring example of the public modules (doctest), and every complete
Python block of the README (those that start with ``import torch``; the others are fragments that name objects the
reader brings, such as a model or a dataset)."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
DOC_MODULES = [
    "hf_flce.api",
    "hf_flce.patches",
    "hf_flce.distributed",
    "hf_flce.trainers.head",
    "hf_flce.data",
]


def _readme_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return [b for b in blocks if b.startswith("import torch\n")]


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    yield
    from hf_flce import revert_flce

    revert_flce()


@pytest.mark.parametrize("module", DOC_MODULES)
def test_docstring_examples(module):
    result = doctest.testmod(
        importlib.import_module(module), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True
    )
    assert result.attempted > 0, f"{module} has no examples"
    assert result.failed == 0


def test_readme_has_complete_examples():
    assert len(_readme_blocks()) >= 5


@pytest.mark.parametrize("index", range(len(_readme_blocks())))
def test_readme_example_runs(index, capsys):
    torch.manual_seed(0)
    code = _readme_blocks()[index]
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "readme_example"})


TRAINERS = ["FLCESFTTrainer", "FLCEDPOTrainer", "FLCEKTOTrainer", "FLCEGRPOTrainer", "FLCERLOOTrainer"]


@pytest.mark.parametrize("name", TRAINERS)
def test_trainer_docstring_example_trains(name, tmp_path, monkeypatch):
    """Each trainer's docstring example (its indented block after ``Example ...::``) trains its step as written."""
    import hf_flce

    doc = getattr(hf_flce, name).__doc__
    block = re.search(r"Example[^:]*::\n\n((?:(?: {8}.*)?\n)+)", doc)
    assert block, f"{name} has no example"
    code = "\n".join(line[8:] for line in block.group(1).splitlines())
    assert f"{name}(" in code and "trainer.train()" in code
    monkeypatch.chdir(tmp_path)  # the examples write under outputs/
    namespace = {"__name__": "docstring_example"}
    exec(compile(code, f"{name} docstring", "exec"), namespace)
    assert namespace["trainer"].state.global_step == 1
