"""Every `splan` example in docs/language.md parses and checks."""

import re

import pytest

import shardplan
from tests.helpers import PLANS, ROOT

DOC = (ROOT / "docs" / "language.md").read_text()
EXAMPLES = re.findall(r"```splan\n(.*?)```", DOC, re.S)


def test_the_reference_has_examples():
    assert len(EXAMPLES) >= 7


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_doc_example_checks(index):
    # extends examples name plans in plans/.
    plan = shardplan.loads(EXAMPLES[index], f"language.md#example{index}", base_dir=PLANS)
    assert plan.mesh
    assert plan.mesh_shape(8)
