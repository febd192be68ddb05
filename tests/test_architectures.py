"""The architecture matrix: every text architecture of the installed mlx-lm, discovered
(not listed), as a tiny random model: EXACT, PASS-THROUGH or REFUSED with a reason.
WRONG (a silent difference from mlx-lm's cache, the recompute oracle, or token-by-token
decoding) and CRASH fail. ``python -m tests.archs`` prints the table."""

import pytest

from tests import archs

ARCHS = archs.architectures()
ROWS = [(a, v) for a in ARCHS for v in [None, *archs.VARIANTS.get(a, {})]]


def test_discovery_finds_the_architectures():
    assert len(ARCHS) > 100 and {"llama", "deepseek_v3", "minicpm3"} <= set(ARCHS)


@pytest.mark.parametrize(
    "arch, variant", ROWS, ids=[a if v is None else f"{a}[{v}]" for a, v in ROWS]
)
def test_exact_or_refused(arch, variant):
    status, reason = archs.classify(arch, variant)
    assert status not in ("WRONG", "CRASH"), f"{arch}: {status}: {reason}"


@pytest.mark.parametrize(
    "arch, where",
    [
        ("deepseek_v3", "values, all dims"),  # MLA: roped k_pe in the values slot
        ("mistral4", "values, all dims"),  # MLA + llama-4 scaling + its own mask use
        ("minicpm3", "keys, last dims"),  # concat(k_nope, roped k_pe)
        ("cohere2", "no position (NoPE)"),  # a rope module its global layer never applies
        ("deepseek_v2", "keys, last dims"),  # roped tail, a rope with no dims attribute
    ],
)
def test_position_families_are_exact(arch, where):
    status, reason = archs.classify(arch)
    assert status == "EXACT" and where in reason, (status, reason)
