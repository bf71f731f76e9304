"""Decode linears on the CPU (``layers/quantization/unquant_cpu.py``, patch 0004): when
``decode_linear`` takes a call, that it matches ``F.linear``, and that upstream's
``UnquantizedLinearMethod.apply`` and the logits processor reach it."""

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.quantization import unquant_cpu
from sglang.srt.layers.quantization.unquant_cpu import decode_linear, parse_max_rows

TOL = dict(atol=1e-2, rtol=1e-2)


@pytest.fixture
def limit(monkeypatch):
    """Sets the resolved row limit (as SGLANG_CPU_DENSE_LINEAR_MAX_ROWS would) for one test."""
    unquant_cpu.max_rows()  # resolve once (imports the op)

    def set_limit(n):
        monkeypatch.setattr(unquant_cpu, "_max_rows", n)

    set_limit(4)
    return set_limit


def test_parse_max_rows():
    assert parse_max_rows(None, 16) == 4
    assert parse_max_rows(" ", 16) == 4
    assert parse_max_rows("0", 16) == 0
    assert parse_max_rows("16", 16) == 16
    with pytest.raises(ValueError, match="SGLANG_CPU_DENSE_LINEAR_MAX_ROWS='x'.*integer"):
        parse_max_rows("x", 16)
    with pytest.raises(ValueError, match="=17: must be in \\[0, 16\\]"):
        parse_max_rows("17", 16)


def test_takes_decode_rows_and_matches_f_linear(limit):
    w = (torch.randn(48, 64) / 8).bfloat16()
    b = torch.randn(48).bfloat16()
    for shape in [(1, 64), (4, 64), (2, 2, 64), (1, 1, 64)]:
        x = torch.randn(*shape).bfloat16()
        y = decode_linear(x, w, b)
        assert y is not None and y.shape == (*shape[:-1], 48)
        torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), **TOL)
    # a column slice of a wider activation (non-contiguous rows) is taken as well
    xs = torch.randn(3, 100).bfloat16()[:, 10:74]
    torch.testing.assert_close(decode_linear(xs, w).float(), F.linear(xs, w).float(), **TOL)


def test_declines_what_upstream_keeps(limit):
    w = torch.randn(8, 16).bfloat16()
    x = torch.randn(2, 16).bfloat16()
    assert decode_linear(torch.randn(5, 16).bfloat16(), w) is None  # prefill: more rows
    assert decode_linear(x.float(), w.float()) is None  # float32 model
    assert decode_linear(x, w.T.contiguous().T) is None  # weight strided along K
    assert decode_linear(x[:0], w) is None  # no rows
    assert decode_linear(x, w, torch.zeros(8, dtype=torch.float16)) is None
    limit(0)  # SGLANG_CPU_DENSE_LINEAR_MAX_ROWS=0: upstream's path everywhere
    assert decode_linear(x, w) is None


def test_unquantized_linear_method_routes_decode_rows(limit, monkeypatch):
    """The patched ``UnquantizedLinearMethod.apply`` asks decode_linear first and falls back
    to F.linear when it declines."""
    from sglang.srt.layers.quantization import unquant

    calls = []

    def spy(x, w, b=None):
        calls.append(tuple(x.shape))
        return decode_linear(x, w, b)

    monkeypatch.setattr(unquant, "decode_linear", spy)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(24, 32).bfloat16(), requires_grad=False)
    method = unquant.UnquantizedLinearMethod()
    for rows in (1, 9):
        x = torch.randn(rows, 32).bfloat16()
        torch.testing.assert_close(
            method.apply(layer, x).float(), F.linear(x, layer.weight).float(), **TOL
        )
    assert calls == [(1, 32), (9, 32)]


def test_logits_processor_imports_the_hook():
    """Patch 0004 also routes the lm_head's plain matmul (``_compute_lm_head``)."""
    import inspect

    from sglang.srt.layers import logits_processor

    assert logits_processor.decode_linear is decode_linear
    assert "decode_linear(" in inspect.getsource(logits_processor.LogitsProcessor._compute_lm_head)
