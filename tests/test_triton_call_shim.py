"""``triton_call.ffi_lowering_shim`` (CPU): jax-triton 0.3.1's legacy-form request becomes the typed-FFI rule with the
call's proto as the ``opaque`` attribute; any other target passes through untouched."""
from dsflash.kernels import triton_call


def _recorder():
    calls = []

    def ffi_lowering(name, **kw):
        calls.append((name, kw))
        return lambda ctx, *args, **attrs: ("rule", name, args, attrs)
    return calls, ffi_lowering


def test_the_ffi_target_gets_api_4_and_the_proto_as_opaque():
    calls, rec = _recorder()
    shim = triton_call.ffi_lowering_shim(rec)
    rule = shim(triton_call.FFI_TARGET, api_version=2, backend_config=b"proto", operand_output_aliases={0: 0})
    assert calls == [(triton_call.FFI_TARGET, {"api_version": 4, "operand_output_aliases": {0: 0}})]
    assert rule("ctx", "a", "b") == ("rule", triton_call.FFI_TARGET, ("a", "b"), {"opaque": b"proto"})


def test_a_call_without_legacy_arguments_passes_through_as_given():
    calls, rec = _recorder()
    triton_call.ffi_lowering_shim(rec)("other_target", operand_output_aliases={})
    assert calls == [("other_target", {"operand_output_aliases": {}})]


def test_other_targets_pass_through_unchanged():
    calls, rec = _recorder()
    shim = triton_call.ffi_lowering_shim(rec)
    rule = shim(triton_call.LEGACY_TARGET, api_version=2, backend_config=b"proto", operand_output_aliases={})
    assert calls == [(triton_call.LEGACY_TARGET, {"api_version": 2, "backend_config": b"proto",
                                                  "operand_output_aliases": {}})]
    assert rule("ctx", "a") == ("rule", triton_call.LEGACY_TARGET, ("a",), {})


def test_a_stand_in_for_jax_triton_is_returned_and_nothing_installed(monkeypatch):
    import sys
    import types
    stub = types.ModuleType("jax_triton")
    monkeypatch.setitem(sys.modules, "jax_triton", stub)
    monkeypatch.setattr(triton_call, "_installed", False)
    monkeypatch.setattr(triton_call, "USE_FFI", True)
    assert triton_call.jax_triton()._jt is stub
    assert triton_call._installed is False


def test_the_ffi_target_is_assumed_only_after_jax_0_10_2(monkeypatch):
    import jax
    for version, expect in (("0.10.2", False), ("0.10.3", True), ("0.11.2", True), ("0.9.0", False)):
        monkeypatch.setattr(jax, "__version__", version)
        assert triton_call.ffi_target_available() is expect, version


def test_launches_get_the_kernels_constexpr_defaults(monkeypatch):
    """jax-triton 0.3.1 sends a constexpr the launch leaves out as None: the launcher fills in the kernel's default
    (the one-split flash launch once left out RD / ROUND_O and did not compile on the GPU), keeps what the launch
    gives, and names a constexpr without a default that is missing."""
    import sys
    import types

    import pytest
    pytest.importorskip("triton")
    from dsflash.kernels import sparse_attention_triton as sat
    seen = []
    stub = types.ModuleType("jax_triton")
    stub.triton_call = lambda *a, kernel, **kw: seen.append(kw) or "out"
    monkeypatch.setitem(sys.modules, "jax_triton", stub)
    monkeypatch.setattr(triton_call, "USE_FFI", False)
    jt = triton_call.jax_triton()
    kernel = sat._flash_kernel
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    assert {"RD", "ROUND_O"} <= set(defaults)
    required = {p.name: 1 for p in kernel.params if p.is_constexpr and not p.has_default}
    assert jt.triton_call("x", kernel=kernel, grid=(1,), **required) == "out"
    assert seen[-1] == {"grid": (1,), **required, **defaults}
    jt.triton_call("x", kernel=kernel, grid=(1,), **required, RD=64)
    assert seen[-1]["RD"] == 64
    gone = next(iter(required))
    with pytest.raises(TypeError, match=gone):
        jt.triton_call("x", kernel=kernel, grid=(1,), **{k: v for k, v in required.items() if k != gone})
