"""The paged indexer scorer's opt-in switches (session 30; NOT YET RUN ON A GPU when written) give the default's bits
on the GPU: ``indexer_paged_triton.KEY_DECODE = "table"`` (the MXFP4 key decode by PRMT byte tables + one bf16x2
multiply a pair, inline PTX), ``PAIRED_ROUND`` (the epilogue's two roundings by cvt.rn.bf16x2.f32 a pair),
``RELU_ONE_COMPARE`` (relu as where(x <= 0, 0, x)), alone, together, and together at 3 stages.

* ``test_key_decode_every_byte_and_scale``: the key tile itself (``_mxfp4_tile`` in ``_key_tile_kernel``, DECODE 1) for
  every packed byte with every scale byte 0-255: KTAB 1 == KTAB 0 bit for bit (NaN bits included), and both ==
  the numpy model of the default's arithmetic (fp32 product, RNE to bf16, subnormals kept: scale bytes 0 / 1).
* ``test_scores_bit_identical``: whole-kernel scores at the decode shape (32 heads x 128, 6 rows), ratio-1 and
  ratio-2 page sizes, with and without candidates, on continuous inputs with NaN / inf queries and weights and
  extreme scale bytes planted: every variant's float32 bits == the default's.
CPU side: tests/test_kernels_indexer_paged.py (the asm in scripts/ptx_emu.py on every code x scale; the interpreter
forms)."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

pytestmark = pytest.mark.gpu

FP32_FORMS = dict(KEY_DECODE="where", PAIRED_ROUND=False, RELU_ONE_COMPARE=False)   # the kernel before session 30
VARIANTS = {  # name: (module switches over FP32_FORMS, num_stages or None)
    "default": (None, None),                              # the module's defaults, whatever they are
    "table": (dict(KEY_DECODE="table"), None),
    "paired": (dict(PAIRED_ROUND=True), None),
    "relu1": (dict(RELU_ONE_COMPARE=True), None),
    "table+paired": (dict(KEY_DECODE="table", PAIRED_ROUND=True), None),
    "all": (dict(KEY_DECODE="table", PAIRED_ROUND=True, RELU_ONE_COMPARE=True), None),
    "all_s3": (dict(KEY_DECODE="table", PAIRED_ROUND=True, RELU_ONE_COMPARE=True), 3),
}


def _model_bits(packed, scales):
    """bf16 bits of the default decode's arithmetic: fp32 E2M1 x 2^(s - 127) (0: 2^-127, 255: inf), RNE (NaN ->
    0x7FFF), subnormals kept."""
    from dsflash import quant
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    s = np.asarray(scales, np.uint32)
    sc = np.where(s == 0, np.float32(2.0 ** -127), (s << 23).view(np.float32)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        prod = (quant.E2M1_VALUES[codes].reshape(codes.shape[0], -1, 32) * sc[:, :, None]).reshape(codes.shape)
    u = prod.view(np.uint32).astype(np.uint64)
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)
    return np.where(np.isnan(prod), np.uint16(0x7FFF), r)


def test_key_decode_every_byte_and_scale():
    from dsflash.kernels.triton_call import jax_triton
    jt = jax_triton()
    Di, BT = 128, 128
    G = np.arange(256 * 16)                                   # scale group G: scale G % 256, bytes 16 (G // 256) + i
    scales = (G % 256).astype(np.uint8).reshape(-1, Di // 32)
    packed = ((G // 256)[:, None] * 16 + np.arange(16)[None, :]).astype(np.uint8).reshape(-1, Di // 2)
    R = packed.shape[0]
    from dsflash.kernels import indexer_paged_triton as ipt
    outs = {}
    for ktab in (0, 1):
        f = jax.jit(lambda p, s, k=ktab: jt.triton_call(
            p, s, kernel=ipt._key_tile_kernel, out_shape=jax.ShapeDtypeStruct((R, Di), jnp.uint16),
            grid=(R // BT,), num_warps=4, num_stages=2, KTAB=k, BT=BT, Di=Di, DECODE=1))
        outs[ktab] = np.asarray(f(jnp.asarray(packed), jnp.asarray(scales)))
    model = _model_bits(packed, scales)
    bad_where = int(np.sum(outs[0] != model))
    bad_table = int(np.sum(outs[1] != model))
    diff = np.argwhere(outs[0] != outs[1])
    detail = [(int(r), int(c), hex(int(outs[0][r, c])), hex(int(outs[1][r, c])), hex(int(model[r, c])))
              for r, c in diff[:8]]
    print(f"where != model: {bad_where}, table != model: {bad_table}, table != where: {len(diff)} {detail}")
    assert len(diff) == 0, detail
    assert bad_where == 0 and bad_table == 0


def _problem(seed, per_page, pages, cand):
    from dsflash import quant
    B, S, Hi, Di = 4, 6, 32, 128
    T = pages * per_page
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    npool = B * pages + 3
    raw = jax.random.normal(ks[0], (npool * per_page, Di))
    qv, sv = quant.mxfp4_quant(raw, 32)
    s = np.asarray(quant.f32_pow2_to_e8m0(sv)).copy()
    rng = np.random.default_rng(seed)
    flat = s.reshape(-1)
    flat[rng.choice(flat.size, 40, replace=False)] = np.tile(np.array([0, 1, 253, 254, 255], np.uint8), 8)
    s[: per_page] = rng.choice(np.array([0, 1, 2], np.uint8), s[: per_page].shape)   # subnormal keys
    pool = {"q": quant.pack_nibbles(quant.e2m1_codes(qv)), "s": jnp.asarray(s)}
    q = np.array(jax.random.normal(ks[1], (B, S, Hi, Di)), np.float32)
    w = np.array(jax.random.normal(ks[2], (B, S, Hi)) * 0.1, np.float32)
    q[1, 2, 3, 4], q[2, 0, 5, 6], q[3, 1, 0, 0] = np.nan, np.inf, -np.inf
    w[0, 3, 7], w[2, 4, 1], w[3, 5, 2] = np.nan, np.inf, -0.0
    pt = jnp.asarray(rng.permutation(npool)[: B * pages].reshape(B, pages), jnp.int32)
    visible = jnp.asarray(rng.integers(0, T + 1, (B, S)), jnp.int32).at[0, 0].set(T)
    valid = jnp.ones((B, S), bool).at[B - 1, S - 1].set(False)
    c = jax.random.uniform(ks[3], (B, S, T)) < 0.5 if cand else None
    return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), pool, pt, per_page, visible, valid, c)


@pytest.mark.parametrize("per_page,pages", [(64, 64), (32, 96)], ids=["ratio1_pp64", "ratio2_pp32"])
@pytest.mark.parametrize("cand", [False, True], ids=["nocand", "cand"])
def test_scores_bit_identical(monkeypatch, per_page, pages, cand):
    from dsflash.kernels import indexer_paged_triton as ipt
    args = _problem(per_page + pages + int(cand), per_page, pages, cand)

    def scores():
        q, w, pool, pt, pp, visible, valid, c = args
        f = jax.jit(lambda q, w, pool, pt, visible, valid, c: ipt.indexer_scores_paged_triton(
            q, w, pool, pt, pp, visible, valid, c))
        return np.asarray(f(q, w, pool, pt, visible, valid, c)).view(np.uint32)

    with monkeypatch.context() as m:
        for k, v in FP32_FORMS.items():
            m.setattr(ipt, k, v)
        want = scores()
    fin = np.isfinite(want.view(np.float32))
    assert fin.sum() > 1000 and np.isnan(want.view(np.float32)).sum() > 0      # the inputs reach both kinds
    bad = {}
    for name, (sets, stages) in VARIANTS.items():
        with monkeypatch.context() as m:
            for k, v in ({} if sets is None else {**FP32_FORMS, **sets}).items():
                m.setattr(ipt, k, v)
            if stages:
                m.setattr(ipt, "NUM_STAGES", stages)
            got = scores()
        n = int(np.sum(got != want))
        print(f"{name}: {n} of {want.size} scores differ in bits")
        if n:
            bad[name] = n
    assert not bad, bad
