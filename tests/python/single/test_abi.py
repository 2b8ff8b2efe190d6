"""The ctypes bindings check their struct layouts against the loaded library's (fv_struct_size)."""
import ctypes

import pytest

from ferrovod import _core


def test_bindings_match_the_library():
    for cname, struct in (("fv_tensor", _core._Tensor), ("fv_op", _core._Op),
                          ("fv_init_options", _core._InitOptions), ("fv_metrics", _core._Metrics)):
        assert _core.LIB.fv_struct_size(cname.encode()) == ctypes.sizeof(struct), cname
    assert _core.LIB.fv_struct_size(b"no_such_struct") == 0


def test_a_struct_of_another_layout_is_refused():
    class ShortOp(ctypes.Structure):  # fv_op as it was before the GPU and compression fields
        _fields_ = _core._Op._fields_[:-3]

    assert _core.LIB.fv_struct_size(b"fv_op") == ctypes.sizeof(_core._Op)
    theirs, ours = ctypes.sizeof(_core._Op), ctypes.sizeof(ShortOp)
    assert ours < theirs
    with pytest.raises(ImportError,
                       match="struct fv_op in %d bytes but these bindings in %d" % (theirs, ours)):
        _core._check_layouts(_core.LIB, (("fv_op", ShortOp),))
