"""The one wire codec: a message is ZeroMQ multipart ``[kind][msgpack header][tensor...]``.

Why this shape: headers are small and must be readable by anything (every header decodes
with plain ``msgpack.unpackb``), while tensors are large and must not be copied. So a
tensor in the header is only ``[dtype, shape, frame index]`` and its bytes travel as a
frame of their own, sent with ``copy=False`` and decoded as a view over the received frame
(``torch.frombuffer``), the layout of pyzmq's ``send_array`` recipe and vLLM's msgpack
encoder. There is no pickle anywhere.

The header is ``{"v": schema version, "f": {field: value}}``. Encoding and decoding are
driven by each message's type hints, compiled once per class; decoding validates every
field and raises ``ProtocolError`` naming it (``GenerateRequest.sampling.top_p: expected
float, got str``). Nothing but ``ProtocolError`` escapes ``decode``, whatever the bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin, get_type_hints

import msgpack
import numpy as np
import zmq

from protocols.errors import ProtocolError
from protocols.messages import MESSAGE_TYPES, Message, Tensor

if TYPE_CHECKING:
    import torch

Frame = bytes | memoryview | zmq.Frame

DEFAULT_MAX_FRAME_BYTES = 1 << 31  # 2 GiB: one weight bucket or rollout batch at most

# Decoded tensors are views over read-only received frames; torch warns about that once
# per call. Writing into a received tensor is a bug anyway, so the warning is noise.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

# torch is imported on the first tensor decoded, not with the codec: a process that only
# passes tensor-free messages (the launcher) never loads it (~200 MB).
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
_NUMPY_NAMES: dict[np.dtype[Any], str] = {np.dtype(name): name for name in _DTYPES if name != "bfloat16"}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in _DTYPES}


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {v: k for k, v in _torch_dtypes().items()}


_KINDS: dict[bytes, type[Message]] = {cls.KIND: cls for cls in MESSAGE_TYPES}
assert len(_KINDS) == len(MESSAGE_TYPES), "two message types share a KIND"

Encoder = Callable[[Any, list[memoryview], str], Any]
Decoder = Callable[[Any, Sequence[memoryview], list[bool], str], Any]


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for ``msg``: kind, msgpack header, then one frame per tensor (no copies)."""
    cls = type(msg)
    if cls not in _COMPILED:
        raise ProtocolError(f"{cls.__name__} is not a registered message type")
    tensors: list[memoryview] = []
    fields = _COMPILED[cls][0](msg, tensors, cls.__name__)
    header = msgpack.packb({"v": cls.SCHEMA_VERSION, "f": fields}, use_bin_type=True)
    frames: list[bytes | memoryview] = [cls.KIND, header]
    frames.extend(tensors)
    return frames


def decode(frames: Sequence[Frame], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """The message in ``frames``; raises ``ProtocolError`` (and nothing else) on bad input."""
    cls, fields, tensor_frames = _open(frames, max_frame_bytes)
    name = cls.__name__
    used = [False] * len(tensor_frames)
    msg = _COMPILED[cls][1](fields, tensor_frames, used, name)
    if not all(used):
        raise ProtocolError(
            f"{name}: {len(tensor_frames)} tensor frames arrived but the header "
            f"references {sum(used)}"
        )
    assert isinstance(msg, Message)
    return msg


def decode_fields(frames: Sequence[Frame], cls: type[Message], names: Sequence[str]) -> dict[str, Any]:
    """Only the fields ``names`` of the ``cls`` message in ``frames``, each decoded and
    checked as ``decode`` does it: for a reader that needs a few fields of many stored
    messages (a buffer replaying its ledger), where decoding every tensor is the cost."""
    found, fields, tensor_frames = _open(frames, DEFAULT_MAX_FRAME_BYTES)
    if found is not cls:
        raise ProtocolError(f"expected a {cls.__name__}, got a {found.__name__}")
    if not isinstance(fields, dict):
        raise _fail(cls.__name__, f"map for {cls.__name__}", fields)
    if cls not in _FIELD_DECODERS:
        hints = get_type_hints(cls)
        _FIELD_DECODERS[cls] = {f.name: _compile(hints[f.name])[1] for f in dataclasses.fields(cls)}
    decoders = _FIELD_DECODERS[cls]
    used = [False] * len(tensor_frames)
    out = {}
    for n in names:
        if n not in fields:
            raise ProtocolError(f"{cls.__name__}.{n}: missing field")
        out[n] = decoders[n](fields[n], tensor_frames, used, f"{cls.__name__}.{n}")
    return out


_FIELD_DECODERS: dict[type[Message], dict[str, Decoder]] = {}


def _open(frames: Sequence[Frame], max_frame_bytes: int) -> tuple[type[Message], Any, list[memoryview]]:
    """A message's class, its header's fields (not checked yet) and its tensor frames."""
    if len(frames) < 2:
        raise ProtocolError(f"a message has at least 2 frames (kind, header); got {len(frames)}")
    views = []
    for i, frame in enumerate(frames):
        view = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
        if view.nbytes > max_frame_bytes:
            raise ProtocolError(
                f"frame {i} is {view.nbytes} bytes, over the limit of {max_frame_bytes}; "
                "raise transport.max_frame_bytes or send smaller buckets"
            )
        views.append(view)
    kind = bytes(views[0])
    cls = _KINDS.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind[:40]!r}; known: {sorted(_KINDS)}")
    name = cls.__name__
    try:
        header = msgpack.unpackb(views[1], raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises many types on garbage; all mean the same
        raise ProtocolError(f"{name}: header is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict) or set(header) != {"v", "f"}:
        raise ProtocolError(f"{name}: header must be a map with keys 'v' and 'f'")
    version = header["v"]
    if version != cls.SCHEMA_VERSION:
        raise ProtocolError(
            f"{name}: schema version {version!r} is not supported (this side speaks "
            f"{cls.SCHEMA_VERSION}); run the same yatt version on both ends"
        )
    return cls, header["f"], views[2:]


# ---------------------------------------------------------------- compiling type hints


def _fail(path: str, expected: str, value: object) -> ProtocolError:
    return ProtocolError(f"{path}: expected {expected}, got {type(value).__name__}")


def _compile(tp: Any) -> tuple[Encoder, Decoder]:
    if tp is Tensor:
        return _encode_tensor, _decode_tensor
    if dataclasses.is_dataclass(tp):
        return _compile_dataclass(tp)  # type: ignore[arg-type]
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return _compile_optional(tp)
    if origin is list:
        return _compile_list(get_args(tp)[0])
    if origin is dict:
        key_tp, val_tp = get_args(tp)
        assert key_tp is str, "message dict keys are strings"
        return _compile_dict(val_tp)
    if tp in (int, float, str, bytes, bool):
        return _compile_scalar(tp)
    raise TypeError(f"unsupported message field type {tp!r}")


def _compile_scalar(tp: type) -> tuple[Encoder, Decoder]:
    name = tp.__name__

    def check(value: Any, path: str) -> Any:
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if type(value) is not tp:
            raise _fail(path, name, value)
        return value

    return (lambda v, _t, p: check(v, p)), (lambda v, _f, _u, p: check(v, p))


def _compile_optional(tp: Any) -> tuple[Encoder, Decoder]:
    args = [a for a in get_args(tp) if a is not type(None)]
    assert len(args) == 1, "only `X | None` unions are supported in messages"
    enc, dec = _compile(args[0])
    return (
        lambda v, t, p: None if v is None else enc(v, t, p),
        lambda v, f, u, p: None if v is None else dec(v, f, u, p),
    )


def _compile_list(item_tp: Any) -> tuple[Encoder, Decoder]:
    enc, dec = _compile(item_tp)

    def encode_list(value: Any, tensors: list[memoryview], path: str) -> Any:
        if not isinstance(value, (list, tuple)):
            raise _fail(path, "list", value)
        return [enc(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]

    def decode_list(value: Any, frames: Sequence[memoryview], used: list[bool], path: str) -> Any:
        if not isinstance(value, list):
            raise _fail(path, "list", value)
        return [dec(v, frames, used, f"{path}[{i}]") for i, v in enumerate(value)]

    return encode_list, decode_list


def _compile_dict(val_tp: Any) -> tuple[Encoder, Decoder]:
    enc, dec = _compile(val_tp)

    def encode_dict(value: Any, tensors: list[memoryview], path: str) -> Any:
        if not isinstance(value, dict):
            raise _fail(path, "dict", value)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _fail(f"{path} key", "str", k)
            out[k] = enc(v, tensors, f"{path}.{k}")
        return out

    def decode_dict(value: Any, frames: Sequence[memoryview], used: list[bool], path: str) -> Any:
        if not isinstance(value, dict):
            raise _fail(path, "map", value)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _fail(f"{path} key", "str", k)
            out[k] = dec(v, frames, used, f"{path}.{k}")
        return out

    return encode_dict, decode_dict


def _compile_dataclass(cls: type) -> tuple[Encoder, Decoder]:
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    # Filled lazily so that a dataclass may refer to one defined later in the module.
    compiled: list[tuple[str, Encoder, Decoder]] = []

    def fields() -> list[tuple[str, Encoder, Decoder]]:
        if not compiled:
            compiled.extend((n, *_compile(hints[n])) for n in names)
        return compiled

    def encode_dc(value: Any, tensors: list[memoryview], path: str) -> Any:
        if type(value) is not cls:
            raise _fail(path, cls.__name__, value)
        return {n: enc(getattr(value, n), tensors, f"{path}.{n}") for n, enc, _ in fields()}

    def decode_dc(value: Any, frames: Sequence[memoryview], used: list[bool], path: str) -> Any:
        if not isinstance(value, dict):
            raise _fail(path, f"map for {cls.__name__}", value)
        extra = set(value) - set(names)
        if extra:
            raise ProtocolError(f"{path}: unknown field(s) {sorted(map(str, extra))}")
        kwargs = {}
        for n, _, dec in fields():
            if n not in value:
                raise ProtocolError(f"{path}.{n}: missing field")
            kwargs[n] = dec(value[n], frames, used, f"{path}.{n}")
        return cls(**kwargs)

    return encode_dc, decode_dc


def _encode_tensor(value: Any, tensors: list[memoryview], path: str) -> Any:
    torch = sys.modules.get("torch")  # a value cannot be a tensor where torch is not loaded
    if torch is not None and isinstance(value, torch.Tensor):
        names = _dtype_names()
        if value.dtype not in names:
            raise ProtocolError(f"{path}: tensor dtype {value.dtype} cannot travel")
        t = value.detach() if value.requires_grad else value
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        dtype, shape = names[t.dtype], list(t.shape)
        # A byte view of the tensor's memory (no copy); it keeps the tensor alive until sent.
        if t.dtype != torch.bfloat16:
            data = t.numpy().reshape(-1).data.cast("B")
        else:  # numpy has no bfloat16: view the bytes in torch first
            data = memoryview(t.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, np.ndarray):
        if value.dtype not in _NUMPY_NAMES:
            raise ProtocolError(f"{path}: array dtype {value.dtype} cannot travel")
        arr = np.ascontiguousarray(value)
        dtype, shape = _NUMPY_NAMES[arr.dtype], list(arr.shape)
        data = arr.reshape(-1).view(np.uint8).data
    else:
        raise _fail(path, "tensor", value)
    tensors.append(data)
    return [dtype, shape, len(tensors) - 1]


def _decode_tensor(value: Any, frames: Sequence[memoryview], used: list[bool], path: str) -> Any:
    if not (isinstance(value, list) and len(value) == 3):
        raise _fail(path, "tensor [dtype, shape, frame]", value)
    dtype_name, shape, index = value
    dtype = _torch_dtypes().get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ProtocolError(f"{path}: unknown tensor dtype {dtype_name!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ProtocolError(f"{path}: tensor shape must be a list of non-negative ints, got {shape!r}")
    if not (type(index) is int and 0 <= index < len(frames)):
        raise ProtocolError(f"{path}: tensor frame index {index!r} out of range ({len(frames)} frames)")
    if used[index]:
        raise ProtocolError(f"{path}: tensor frame {index} is referenced twice")
    used[index] = True
    frame = frames[index]
    numel = math.prod(shape)
    expected = numel * dtype.itemsize
    if frame.nbytes != expected:
        raise ProtocolError(
            f"{path}: tensor {dtype_name}{shape} needs {expected} bytes, its frame has {frame.nbytes}"
        )
    import torch

    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(frame, dtype=dtype).view(shape)


_COMPILED: dict[type[Message], tuple[Encoder, Decoder]] = {
    cls: _compile_dataclass(cls) for cls in MESSAGE_TYPES
}
