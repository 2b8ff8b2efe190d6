"""Gradient compressors with Horovod's interface, for any framework: `compress(tensor) ->
(tensor, ctx)` and `decompress(tensor, ctx)`, plus `core`, the fv_compression code under which
ferrovod's core compresses float32 sums and averages itself (cast while packed into the fusion
buffer and back while unpacked: no Python cast, no extra pass over the tensor). What the core
leaves (other dtypes, other ops) is cast by `compress`, as Horovod's compressors do.

`compression_for(framework)` builds the `Compression` namespace of one framework from three
functions on its tensors."""

from ferrovod import _core


class Compressor:
    """Interface: `compress(tensor) -> (tensor, ctx)`, `decompress(tensor, ctx) -> tensor`."""

    core = None

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class Framework:
    """What the compressors need of a framework's tensors: `is_floating(tensor)`,
    `cast(tensor, dtype)`, `dtype(tensor)`, and its float16 dtype."""

    def __init__(self, is_floating, cast, dtype, float16):
        self.is_floating, self.cast, self.dtype, self.float16 = is_floating, cast, dtype, float16


def compression_for(fw):
    """The `Compression` namespace (none, fp16, bf16, mixed, u8, powersgd, topk) over
    framework `fw`."""

    class NoneCompressor(Compressor):
        """Nothing compressed here (the job's FERROVOD_COMPRESSION still applies in the core)."""

        @staticmethod
        def compress(tensor):
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor

    class FP16Compressor(Compressor):
        """float32 sums and averages travel as IEEE half precision in the core; other floating
        tensors (and other ops) are cast to float16 here and back, as Horovod does."""

        core = _core.COMPRESSION_FP16

        @staticmethod
        def compress(tensor):
            if fw.is_floating(tensor) and fw.dtype(tensor) != fw.float16:
                return fw.cast(tensor, fw.float16), fw.dtype(tensor)
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else fw.cast(tensor, ctx)

    class BF16Compressor(NoneCompressor):
        """ferrovod extension: float32 sums and averages travel as bfloat16 (float32's range,
        8 bits of mantissa); other tensors travel as they are."""

        core = _core.COMPRESSION_BF16

    class MixedCompressor(NoneCompressor):
        """ferrovod extension: float32 sums and averages below FERROVOD_COMPRESSION_MIN_BYTES
        travel as float32, larger ones as IEEE half precision (AIACC's mixed precision)."""

        core = _core.COMPRESSION_MIXED

    class U8Compressor(NoneCompressor):
        """ferrovod extension: float32 sums and averages travel as 8-bit min-max blocks with
        error feedback (what rounding loses is added to the tensor's next allreduce, kept per
        tensor name), summed in float32; on host memory and on GPUs."""

        core = _core.COMPRESSION_U8

    class PowerSGDCompressor(NoneCompressor):
        """ferrovod extension: float32 sums and averages of matrices (a tensor seen as its first
        dimension by the rest) travel as PowerSGD's two low-rank factors with error feedback,
        state kept per tensor name, rank FERROVOD_POWERSGD_RANK (or `powersgd(rank=r)`'s);
        vectors and matrices whose factors would not be smaller travel as they are; on host
        memory and on GPUs."""

        core = _core.COMPRESSION_POWERSGD
        # the core needs each gradient's own shape: optimizers must not flatten gradients into
        # buckets for it
        keeps_shapes = True

        def __init__(self, rank):
            """`Compression.powersgd(rank=r)`: factors of r columns (1 to 1024) for the
            operations given this compressor, whatever the job's rank."""
            self.core = powersgd_code(rank)

    class TopKCompressor(NoneCompressor):
        """ferrovod extension: float32 sums and averages travel as each rank's values of largest
        magnitude (FERROVOD_TOPK_RATIO of them, 1 % by default, or `topk(ratio)`'s) as (index,
        value) pairs, with error feedback and optional momentum correction
        (FERROVOD_TOPK_MOMENTUM), state kept per tensor name; on host memory and on GPUs."""

        core = _core.COMPRESSION_TOPK

        def __init__(self, ratio):
            """`Compression.topk(ratio)`: this share of the values (0 < ratio <= 1, in whole
            millionths) for the operations given this compressor, whatever the job's ratio."""
            self.core = topk_code(ratio)

    class Compression:
        none = NoneCompressor
        fp16 = FP16Compressor
        bf16 = BF16Compressor
        mixed = MixedCompressor
        u8 = U8Compressor
        powersgd = PowerSGDCompressor
        topk = TopKCompressor

    return Compression


# PowerSGD's largest rank (the core's POWERSGD_MAX_RANK)
_MAX_RANK = 1024


def powersgd_code(rank):
    """The fv_compression value of PowerSGD with an operation's own rank (bits 8 and up)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= _MAX_RANK:
        raise ValueError("PowerSGD rank %r is out of range (1 to %d)" % (rank, _MAX_RANK))
    return _core.COMPRESSION_POWERSGD | (rank << 8)


def topk_code(ratio):
    """The fv_compression value of top-k with an operation's own ratio, in millionths (bits 8
    and up)."""
    try:
        ok = not isinstance(ratio, bool) and 0 < float(ratio) <= 1
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError("top-k ratio %r is out of range (0 < ratio <= 1)" % (ratio,))
    return _core.COMPRESSION_TOPK | (max(1, int(round(float(ratio) * 1e6))) << 8)


def core_codec(compression, is_float32, op):
    """The fv_compression value to hand the core for an allreduce with `op` of a tensor
    (`is_float32`), or None when `compression` must run in Python (a custom compressor, or what
    the core leaves)."""
    core = getattr(compression, "core", None)
    if core is None or not is_float32 or op not in (_core.SUM, _core.AVERAGE):
        return None
    return core
