"""The wire codec: every message round-trips, headers are plain msgpack, tensors travel
without copies, and every kind of bad input raises ProtocolError naming what is wrong."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocols as P
from protocols.codec import decode, decode_fields, encode
from yatt.errors import ProtocolError

KEY = P.GroupKey(epoch=1, shard=2, prompt_index=3, attempt=1)
WORKER = P.WorkerInfo(actor_id="generator-0@ab", role="generator", endpoint="tcp://127.0.0.1:5000", meta={"gpu": "0"})


def _completion(n: int) -> P.Completion:
    return P.Completion(
        token_ids=torch.arange(n, dtype=torch.int32),
        logprobs=-torch.rand(n),
        finish_reason="stop",
        policy_version_min=3,
        policy_version_max=4,
    )


SAMPLES: list[P.Message] = [
    P.GenerateRequest(
        group_key=KEY,
        prompt_ids=torch.tensor([5, 6, 7], dtype=torch.int32),
        n=4,
        sampling=P.SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=8, stop_token_ids=[2], seed=7),
        min_policy_version=2,
    ),
    P.Completions(group_key=KEY, completions=[_completion(3), _completion(0), _completion(5)]),
    P.ScoreRequest(
        group_key=KEY,
        prompt_ids=torch.tensor([1, 2], dtype=torch.int32),
        completion_ids=[torch.tensor([3], dtype=torch.int32), torch.tensor([4, 5], dtype=torch.int32)],
        finish_reasons=["stop", "length"],
        metadata={"answer": "42"},
    ),
    P.Scores(
        group_key=KEY,
        rewards=torch.tensor([1.0, 0.0]),
        components={"math": torch.tensor([1.0, 0.0]), "format": torch.tensor([0.5, 0.5])},
        failures=["", "math: timed out after 10.0s"],
    ),
    P.ScoredGroup(
        group_key=KEY,
        prompt_ids=torch.tensor([1, 2], dtype=torch.int32),
        completion_ids=[torch.tensor([3], dtype=torch.int32)],
        rollout_logprobs=[torch.tensor([-0.5])],
        rewards=torch.tensor([1.0]),
        advantages=torch.tensor([0.0]),
        policy_versions=torch.tensor([3], dtype=torch.int64),
        finish_reasons=["stop"],
        scores={"math": torch.tensor([1.0])},
        failures=[""],
    ),
    P.TurnsRequest(group_key=KEY),
    P.TurnRecords(
        group_key=KEY,
        records=[
            P.TurnRecord(
                group_key=KEY, sample=1, turn=2, token_ids=torch.tensor([5, 6], dtype=torch.int32),
                logprobs=torch.tensor([-0.5, -0.25]), policy_version=3, finish_reason="stop",
                obs_ids=torch.tensor([7], dtype=torch.int32), reward=0.5, tool_errors=1, ended="", detail="",
                env_state=b"saved",
            ),
        ],
    ),
    P.EnvCall(episode="e0/s0/p1/a0/2/ab12", method="restore", turn=3, seed=7, row_json='{"prompt": "p"}', action="4", state=b"\x00s"),
    P.EnvReply(
        episode="e0/s0/p1/a0/2/ab12", messages=[{"role": "user", "content": "Higher."}], reward=None, terminated=False,
        truncated=True, tool_errors=2, tools_json="[]", snapshots=True, state=b"\x01",
    ),
    P.TurnRecord(
        group_key=KEY, sample=0, turn=0, token_ids=torch.tensor([5], dtype=torch.int32), logprobs=torch.tensor([-1.0]),
        policy_version=0, finish_reason="length", obs_ids=torch.tensor([], dtype=torch.int32), reward=1.0,
        tool_errors=0, ended="done", detail="",
    ),
    P.StepReport(
        step=3,
        values={"reward/mean": 0.5},
        groups=[
            P.ScoredGroup(
                group_key=KEY,
                prompt_ids=torch.tensor([1, 2], dtype=torch.int32),
                completion_ids=[torch.tensor([3, 4], dtype=torch.int32)],
                rollout_logprobs=[torch.tensor([-0.5, -0.25])],
                rewards=torch.tensor([0.0]),
                advantages=torch.tensor([0.0]),
                policy_versions=torch.tensor([2], dtype=torch.int64),
                finish_reasons=["length"],
                forked=[
                    P.ForkedRow(
                        sample=0, prompt_ids=torch.tensor([9, 3], dtype=torch.int32),
                        completion_ids=torch.tensor([5, 6], dtype=torch.int32), completion_mask=torch.tensor([True, False]),
                        rollout_logprobs=torch.tensor([-0.5, 0.0]), token_versions=torch.tensor([3, -1], dtype=torch.int64),
                        advantages=torch.tensor([0.5, 0.0]),
                    )
                ],
            )
        ],
    ),
    P.MicroBatchRequest(step=3, rank=1, world_size=2, index=0),
    P.PlanRequest(shard=1, num_shards=2, after_seq=-1, wait_s=0.5),
    P.DispatchPlan(plan_seq=4, keys=[KEY], min_policy_version=2, step=2),
    P.MicroBatch(
        step=3,
        rank=1,
        index=0,
        count=2,
        input_ids=torch.ones(2, 4, dtype=torch.int64),
        attention_mask=torch.ones(2, 4, dtype=torch.bool),
        loss_mask=torch.tensor([[False, True, True, False], [False, False, True, True]]),
        rollout_logprobs=torch.zeros(2, 4),
        advantages=torch.ones(2, 4),
        policy_versions=torch.tensor([3, 2]),
        group_keys=[KEY, KEY],
    ),
    P.WeightUpdate(
        version=4,
        bucket_index=0,
        num_buckets=1,
        names=["lm_head.weight", "norm.weight"],
        tensors=[torch.randn(3, 2).to(torch.bfloat16), torch.ones(2, dtype=torch.float16)],
    ),
    P.Register(worker=WORKER),
    P.Deregister(actor_id="generator-0@ab"),
    P.Heartbeat(actor_id="generator-0@ab", seq=9),
    P.Membership(epoch=2, workers=[WORKER, dataclasses.replace(WORKER, actor_id="reward-0@cd", role="reward")]),
    P.PolicyVersion(version=5),
    P.Query(what="members", args={"role": "generator"}),
    P.Metrics(values={"depth": 3.0, "reward/mean": 0.5}),
    P.Ack(seq=12, info={"status": "accepted"}),
    P.Error(error_type="ValueError", message="bad", traceback="Traceback ..."),
    P.Shutdown(reason="done"),
]


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            _equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def test_every_message_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(P.MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: P.Message) -> None:
    frames = encode(msg)
    assert frames[0] == type(msg).KIND
    assert _equal(decode([bytes(f) for f in frames]), msg)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_header_is_plain_msgpack(msg: P.Message) -> None:
    header = msgpack.unpackb(encode(msg)[1])
    assert header["v"] == type(msg).SCHEMA_VERSION
    assert set(header["f"]) == {f.name for f in dataclasses.fields(msg)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool])
def test_tensor_dtypes_round_trip(dtype: torch.dtype) -> None:
    t = (torch.randn(3, 5) * 10).to(dtype)
    msg = P.WeightUpdate(version=1, bucket_index=0, num_buckets=1, names=["w"], tensors=[t])
    out = decode(encode(msg))
    assert isinstance(out, P.WeightUpdate)
    assert out.tensors[0].dtype == dtype and torch.equal(out.tensors[0], t)


def test_numpy_arrays_encode() -> None:
    arr = np.arange(6, dtype=np.int64).reshape(2, 3)
    msg = P.WeightUpdate(version=1, bucket_index=0, num_buckets=1, names=["w"], tensors=[arr])  # type: ignore[list-item]
    out = decode(encode(msg))
    assert isinstance(out, P.WeightUpdate)
    assert torch.equal(out.tensors[0], torch.from_numpy(arr))


def test_tensors_are_separate_frames_and_not_copied() -> None:
    t = torch.randn(1024)
    frames = encode(P.WeightUpdate(version=1, bucket_index=0, num_buckets=1, names=["w"], tensors=[t]))
    assert len(frames) == 3
    view = frames[2]
    assert isinstance(view, memoryview)
    # The frame is a view over the tensor's own memory: encoding copied nothing.
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data == t.data_ptr()
    # Decoding is a view over the received frame, too.
    received = bytearray(view)
    out = decode([frames[0], frames[1], memoryview(received)])
    assert isinstance(out, P.WeightUpdate)
    assert out.tensors[0].data_ptr() == np.frombuffer(received, dtype=np.uint8).ctypes.data


def test_zero_copy_over_a_real_socket() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://codec")
        b.connect("inproc://codec")
        t = torch.randn(256, 256)
        a.send_multipart(encode(P.WeightUpdate(version=1, bucket_index=0, num_buckets=1, names=["w"], tensors=[t])), copy=False)
        out = decode(b.recv_multipart(copy=False))
        assert isinstance(out, P.WeightUpdate)
        assert torch.equal(out.tensors[0], t)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


# ---------------------------------------------------------------- bad input


def _frames(msg: P.Message) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def _with_header(msg: P.Message, edit: object) -> list[bytes]:
    frames = _frames(msg)
    header = msgpack.unpackb(frames[1])
    assert callable(edit)
    edit(header)
    frames[1] = msgpack.packb(header)
    return frames


def test_unknown_kind() -> None:
    frames = _frames(P.Shutdown())
    frames[0] = b"nope"
    with pytest.raises(ProtocolError, match="unknown message kind b'nope'"):
        decode(frames)


def test_wrong_schema_version() -> None:
    frames = _with_header(P.Shutdown(), lambda h: h.update(v=99))
    with pytest.raises(ProtocolError, match="Shutdown: schema version 99 is not supported"):
        decode(frames)


def test_missing_field() -> None:
    frames = _with_header(SAMPLES[0], lambda h: h["f"]["sampling"].pop("top_p"))
    with pytest.raises(ProtocolError, match=r"GenerateRequest\.sampling\.top_p: missing field"):
        decode(frames)


def test_ill_typed_field() -> None:
    frames = _with_header(SAMPLES[0], lambda h: h["f"]["sampling"].update(top_p="high"))
    with pytest.raises(ProtocolError, match=r"GenerateRequest\.sampling\.top_p: expected float, got str"):
        decode(frames)


def test_unknown_field() -> None:
    frames = _with_header(P.Heartbeat(actor_id="a", seq=1), lambda h: h["f"].update(extra=1))
    with pytest.raises(ProtocolError, match=r"Heartbeat: unknown field\(s\) \['extra'\]"):
        decode(frames)


def test_bool_is_not_an_int() -> None:
    frames = _with_header(P.Heartbeat(actor_id="a", seq=1), lambda h: h["f"].update(seq=True))
    with pytest.raises(ProtocolError, match=r"Heartbeat\.seq: expected int, got bool"):
        decode(frames)


def test_tensor_byte_count_must_match_shape() -> None:
    frames = _frames(SAMPLES[0])
    frames[2] = frames[2][:-1]
    with pytest.raises(ProtocolError, match=r"GenerateRequest\.prompt_ids: tensor int32\[3\] needs 12 bytes, its frame has 11"):
        decode(frames)


def test_missing_and_extra_tensor_frames() -> None:
    frames = _frames(SAMPLES[0])
    with pytest.raises(ProtocolError, match="frame index 0 out of range"):
        decode(frames[:2])
    with pytest.raises(ProtocolError, match="2 tensor frames arrived but the header references 1"):
        decode([*frames, b"x"])


def test_frame_over_size_limit() -> None:
    frames = _frames(P.WeightUpdate(version=1, bucket_index=0, num_buckets=1, names=["w"], tensors=[torch.zeros(100)]))
    with pytest.raises(ProtocolError, match="frame 2 is 400 bytes, over the limit of 100"):
        decode(frames, max_frame_bytes=100)


def test_truncated_and_garbage_header() -> None:
    frames = _frames(SAMPLES[0])
    with pytest.raises(ProtocolError, match="header is not valid msgpack"):
        decode([frames[0], frames[1][:10], *frames[2:]])
    with pytest.raises(ProtocolError, match="header is not valid msgpack"):
        decode([frames[0], b"\xc1\xc1\xc1"])
    with pytest.raises(ProtocolError, match="at least 2 frames"):
        decode([frames[0]])


def test_encode_rejects_wrong_types() -> None:
    with pytest.raises(ProtocolError, match=r"Heartbeat\.seq: expected int, got str"):
        encode(P.Heartbeat(actor_id="a", seq="1"))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=r"GenerateRequest\.prompt_ids: expected tensor, got list"):
        encode(dataclasses.replace(SAMPLES[0], prompt_ids=[1, 2]))  # type: ignore[call-arg]


_frame_lists = st.lists(st.binary(max_size=64), min_size=0, max_size=6)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([m.KIND for m in SAMPLES]) | st.binary(max_size=8), _frame_lists)
def test_random_frames_raise_only_protocol_error(kind: bytes, rest: list[bytes]) -> None:
    try:
        decode([kind, *rest])
    except ProtocolError:
        pass


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(SAMPLES))), st.data())
def test_mutated_frames_raise_only_protocol_error(index: int, data: st.DataObject) -> None:
    frames = [bytearray(f) for f in _frames(SAMPLES[index])]
    which = data.draw(st.integers(0, len(frames) - 1))
    if frames[which]:
        for _ in range(data.draw(st.integers(1, 4))):
            pos = data.draw(st.integers(0, len(frames[which]) - 1))
            frames[which][pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        frames[which] = frames[which][: data.draw(st.integers(0, len(frames[which])))]
    try:
        decode([bytes(f) for f in frames])
    except ProtocolError:
        pass


_header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(SAMPLES))), st.data())
def test_well_formed_msgpack_with_wrong_contents_raises_only_protocol_error(index: int, data: st.DataObject) -> None:
    msg = SAMPLES[index]
    frames = _frames(msg)
    header = msgpack.unpackb(frames[1])
    names = sorted(header["f"])
    name = data.draw(st.sampled_from(names))
    header["f"][name] = data.draw(_header_values)
    frames[1] = msgpack.packb(header, use_bin_type=True)
    try:
        decode(frames)
    except ProtocolError:
        pass


def test_no_pickle_anywhere() -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    pattern = re.compile(r"\b(import pickle|from pickle|cloudpickle|dill\b|torch\.load\(|pickle\.)")
    offenders = []
    for package in ("yatt", "protocols", "workers", "launch"):
        for path in (root / package).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and "weights_only=True" not in line:
                    offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert offenders == []


def test_decode_fields_decodes_only_the_fields_asked_for() -> None:
    """What a buffer's replay reads of a stored group: the fields asked for, checked as
    ``decode`` checks them; the wrong message type or a bad field is a ProtocolError."""
    key = P.GroupKey(epoch=1, shard=0, prompt_index=5, attempt=2)
    group = P.ScoredGroup(
        group_key=key, prompt_ids=torch.arange(3, dtype=torch.int32),
        completion_ids=[torch.arange(4, dtype=torch.int32)] * 2, rollout_logprobs=[torch.zeros(4)] * 2,
        rewards=torch.tensor([1.0, 0.0]), advantages=torch.tensor([0.5, -0.5]),
        policy_versions=torch.tensor([3, 4]), finish_reasons=["stop", "length"],
    )  # fmt: skip
    frames = [bytes(f) for f in encode(group)]
    fields = decode_fields(frames, P.ScoredGroup, ("group_key", "rewards"))
    assert set(fields) == {"group_key", "rewards"} and fields["group_key"] == key
    assert torch.equal(fields["rewards"], group.rewards)
    with pytest.raises(ProtocolError, match="expected a ScoredGroup, got a Ack"):
        decode_fields([bytes(f) for f in encode(P.Ack(seq=1))], P.ScoredGroup, ("rewards",))
    header = msgpack.unpackb(frames[1])
    header["f"]["rewards"] = ["float32", [3], 5]  # the wrong shape for its frame
    bad = [frames[0], msgpack.packb(header), *frames[2:]]
    with pytest.raises(ProtocolError, match=r"ScoredGroup\.rewards: tensor"):
        decode_fields(bad, P.ScoredGroup, ("rewards",))
    del header["f"]["rewards"]
    with pytest.raises(ProtocolError, match=r"ScoredGroup\.rewards: missing field"):
        decode_fields([frames[0], msgpack.packb(header), *frames[2:]], P.ScoredGroup, ("rewards",))


TORCH_FREE = """
import sys
import numpy as np
import protocols as P
frames = [bytes(f) for f in P.encode(P.Query(what="stats", args={"step": "3"}))]
assert P.decode(frames) == P.Query(what="stats", args={"step": "3"})
print("torch" in sys.modules)
ids = np.arange(5, dtype=np.int32)  # a tensor field encoded from numpy, as a torch-free sender may
completion = P.Completion(token_ids=ids, logprobs=np.zeros(5, np.float32), finish_reason="stop", policy_version_min=0, policy_version_max=0)
frames = [bytes(f) for f in P.encode(P.Completions(group_key=P.GroupKey(epoch=0, shard=0, prompt_index=1), completions=[completion]))]
got = P.decode(frames)
got = got.completions[0]
print("torch" in sys.modules, type(got.token_ids).__name__, got.token_ids.tolist())
"""


def test_the_codec_loads_torch_on_the_first_tensor_only() -> None:
    """A process that passes only tensor-free messages (the launcher) never imports torch
    (~200 MB); the first tensor it decodes does, and comes out a torch tensor."""
    import subprocess
    import sys

    root = pathlib.Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", TORCH_FREE], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "Tensor", "[0,", "1,", "2,", "3,", "4]"], done.stdout
