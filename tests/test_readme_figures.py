"""The figures README.md quotes from the benchmarks are the ones docs/benchmarks.md (the
benchmark's own output, `python -m benchmarks --write`) reports: the shapes cache on the
Llama-2-70B shapes (first check, cached check) and the language server (median and slowest
edit, the plan's rules and the state's leaves)."""

import re

import pytest

from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()
BENCHMARKS = (ROOT / "docs" / "benchmarks.md").read_text()


def found(pattern: str, text: str, where: str) -> re.Match:
    m = re.search(pattern, text, re.S)
    assert m, f"{where} no longer says what this test reads ({pattern!r}): update the test with the text"
    return m


def section(title: str) -> str:
    """One '## N. title' section of docs/benchmarks.md."""
    return found(rf"## \d+\. {re.escape(title)}\n(.*?)(?=\n## |\Z)", BENCHMARKS, "docs/benchmarks.md").group(1)


def same(readme: str, docs: str) -> bool:
    """The README's figure is the benchmark's, rounded to as many decimals as the README shows."""
    decimals = len(readme.partition(".")[2])
    return float(readme.replace(",", "")) == round(float(docs.replace(",", "")), decimals)


SHAPES_CACHE, LSP = "The shapes cache", "The language server"

# (what, README pattern, docs/benchmarks.md section title, the pattern there); each pattern's one
# group is the figure.
FIGURES = [
    (
        "70B shapes cache, first check (s)",
        r"Llama-2-70B: ([\d.]+) s, then [\d.]+ s",
        SHAPES_CACHE,
        r"llama2_70b`.*?fills the cache, ([\d.]+) s",
    ),
    (
        "70B shapes cache, cached check (s)",
        r"Llama-2-70B: [\d.]+ s, then ([\d.]+) s",
        SHAPES_CACHE,
        r"read them back[^,]*, ([\d.]+) s",
    ),
    (
        "language server, median edit (ms)",
        r"([\d.]+) ms median, [\d.]+ ms slowest per edit",
        LSP,
        r"median ([\d.]+) ms",
    ),
    (
        "language server, slowest edit (ms)",
        r"[\d.]+ ms median, ([\d.]+) ms slowest per edit",
        LSP,
        r"slowest ([\d.]+) ms",
    ),
    ("language server, rules", r"slowest per edit for a (\d+)-rule plan", LSP, r"the (\d+)-rule plan"),
    ("language server, leaves", r"-rule plan against a ([\d,]+)-leaf state", LSP, r"([\d,]+) leaves\)"),
]


@pytest.mark.parametrize("what, readme, docs, pattern", FIGURES, ids=[f[0] for f in FIGURES])
def test_readme_quotes_the_benchmarks_figure(what, readme, docs, pattern):
    ours = found(readme, README, "README.md").group(1)
    theirs = found(pattern, section(docs), f"docs/benchmarks.md section {docs!r}").group(1)
    assert same(ours, theirs), f"{what}: README.md says {ours}, docs/benchmarks.md {theirs}"


def test_same_rounds_to_the_readmes_precision():
    assert same("1.7", "1.66") and same("0.24", "0.24") and same("93", "93") and same("99,092", "99,092")
    assert not same("4.7", "1.66") and not same("0.20", "0.24") and not same("87", "93")


def test_readme_corpus_figures_are_the_files():
    """"a bundled 42 KB corpus, character tokens, 10% held out": the file's size and the default."""
    import inspect

    from examples import data

    kb = int(found(r"a bundled (\d+) KB corpus", README, "README.md").group(1))
    assert kb == round((ROOT / "examples" / "data" / "corpus.txt").stat().st_size / 1000)
    held = int(found(r"character\s+tokens, (\d+)% held out", README, "README.md").group(1))
    assert held / 100 == inspect.signature(data.TextData).parameters["eval_fraction"].default


def readme_sp_temporaries() -> tuple[float, float]:
    """README's "(llama_tp) 46.8 MB to (llama_sp) 34.4 MB" of XLA temporaries, in MB."""
    m = found(r"fall from\s+([\d.]+) MB under `llama_tp` to ([\d.]+) MB", README, "README.md")
    return float(m.group(1)), float(m.group(2))
