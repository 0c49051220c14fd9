"""Codec: round trips, frozen encodings (golden bytes), zero copy, no pickle."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from asyncrl.wire.codec import Codec
from asyncrl.errors import ProtocolError
from asyncrl.wire.messages import (
    PROTOCOL_VERSION,
    Call,
    Cast,
    DataBatch,
    DataMessage,
    FromWorker,
    GenRequest,
    Generate,
    GroupFailed,
    Hello,
    LogprobsResult,
    Reply,
    Sample,
    SampleDone,
    ToWorker,
    TrainBatch,
    TrainChunk,
)

# Frozen encodings. If one of these changes, the wire format changed: bump PROTOCOL_VERSION
# and say so in CHANGELOG.md, then update the bytes here.
GOLDEN = {
    "hello": "86a16ba568656c6c6fb070726f746f636f6c5f76657273696f6e01a567726f7570a7726f6c6c6f7574a472616e6b01aa776f726c645f73697a6502a3706964cd3039",
    "reply_lp": "83a16ba57265706c79a763616c6c5f696403a6726573756c7482a16ba26c70a86c6f6770726f6273d7019301a33c66349104",
    # [tag "s", group "a", worker "rollout:0", index 0, sample [ext(frame 1, "<i4", [2]),
    #  ext(frame 2, "<f4", [2]), "stop"]] (written out by hand from the msgpack spec)
    # Sample (protocol 9): [tokens (frame 1), logprobs (frame 2), "stop", versions (frame 3)]
    "sample_done": "95a173a161a9726f6c6c6f75743a300094d7019301a33c69349102d7019302a33c66349102a473746f70d7019303a33c69349102",
    # [tag "db", [SampleDone as above, GroupFailed ["gf", "b", "rollout:0", "E", "m"]]]
    "data_batch": "92a264629295a173a161a9726f6c6c6f75743a300094d7019301a33c69349102d7019302a33c66349102a473746f70d7019303a33c6934910296a26766a162a9726f6c6c6f75743a30a145a16dc3",
}


def hexbody(frames: list) -> str:
    return bytes(frames[0]).hex()


def test_protocol_version_is_seventeen() -> None:
    # 2: samples stream one by one (SampleDone replaced GroupDone); 3: refits open with a
    # Manifest and bucket handles are transfer-specific bytes; 4: DataBatch; 5: SaveState,
    # LoadState, ExportModel, GroupFailed.retryable; 6: SendWeights.receiver_pids;
    # 7: ResetPrefixCache (tag reset_pc, never sent) left the Request union;
    # 8: TrainBatch.loss_mask; 9: Sample.versions, ReceiveWeights.reprefill; 10: Cast (a
    # Generate is sent unanswered); 11: FinishStep.normalizer (an older trainer would
    # divide by the tokens whatever loss.aggregation says); 12: TrainBatch.proximal_logprobs
    # and reference_logprobs, ComputeLogprobs.policy, ChunkResult.kl_sum; 13: Hello.host
    # (a worker on another host is refused: its pid means nothing to the controller);
    # 14: SendWeights.receiver_hosts (the nccl transfer sends a bucket once per host);
    # 15: ComputeLogprobs.policy "sent", and every socket CURVE (ipc too: a peer without the
    # run's keys fails its handshake); 16: StepResult.peak_allocated_bytes and
    # peak_reserved_bytes; 17: Sleep, MoveState, TurnResult (taking turns on a GPU); 18:
    # a job on GenRequest, ScoreTokens, ReceiveWeights, ComputeLogprobs, BeginStep,
    # TrainChunk, FinishStep, SendWeights; OpenJob, CloseJob (jobs on one base model)
    assert PROTOCOL_VERSION == 18


def test_golden_hello() -> None:
    msg = Hello(protocol_version=1, group="rollout", rank=1, world_size=2, pid=12345)
    frames = Codec(FromWorker).encode(msg)
    assert len(frames) == 1
    assert hexbody(frames) == GOLDEN["hello"]
    assert Codec(FromWorker).decode([bytes.fromhex(GOLDEN["hello"])]) == msg


def test_golden_reply_with_array_frame() -> None:
    msg = Reply(call_id=3, result=LogprobsResult(logprobs=np.arange(4, dtype=np.float32)))
    frames = Codec(FromWorker).encode(msg)
    assert hexbody(frames) == GOLDEN["reply_lp"]
    assert bytes(frames[1]) == np.arange(4, dtype="<f4").tobytes()


def test_golden_sample_done_is_array_like() -> None:
    msg = SampleDone(
        "a",
        "rollout:0",
        0,
        Sample(np.array([1, 2], np.int32), np.array([-0.5, -0.1], np.float32), "stop",
               np.array([3, 4], np.int32)),
    )
    frames = Codec(DataMessage).encode(msg)
    assert hexbody(frames) == GOLDEN["sample_done"]
    assert len(frames) == 4
    back = Codec(DataMessage).decode([bytes(f) for f in frames])
    assert back.sample.token_ids.tolist() == [1, 2]
    assert back.sample.logprobs.dtype == np.float32
    assert back.sample.versions.tolist() == [3, 4]


def test_golden_data_batch_holds_items_in_order() -> None:
    sample = Sample(np.array([1, 2], np.int32), np.array([-0.5, -0.1], np.float32), "stop",
                    np.array([3, 4], np.int32))
    items = [SampleDone("a", "rollout:0", 0, sample), GroupFailed("b", "rollout:0", "E", "m")]
    msg = DataBatch(items)  # type: ignore[arg-type]
    frames = Codec(DataMessage).encode(msg)
    assert hexbody(frames) == GOLDEN["data_batch"]
    assert len(frames) == 4  # the sample's three arrays, once each
    back = Codec(DataMessage).decode([bytes(f) for f in frames])
    assert isinstance(back, DataBatch)
    assert back.items[0].sample.token_ids.tolist() == [1, 2]
    assert back.items[1] == msg.items[1]


def test_round_trip_nested_request() -> None:
    batch = TrainBatch(
        tokens=np.arange(7, dtype=np.int32),
        seq_lens=np.array([3, 4], np.int32),
        prompt_lens=np.array([1, 2], np.int32),
        behaviour_logprobs=np.array([-1, -2, -3, -4], np.float32),
        advantages=np.array([0.5, -0.5], np.float32),
        loss_mask=np.array([1, 0, 0, 1], np.uint8),
    )
    msg = Call(call_id=9, request=TrainChunk(step=2, batch=batch))
    codec = Codec(ToWorker)
    frames = codec.encode(msg)
    assert len(frames) == 1 + 6  # the body and one frame per array, the mask's among them
    back = codec.decode(frames)
    assert isinstance(back.request, TrainChunk)
    assert list(TrainBatch.__struct_fields__)[5] == "loss_mask"  # appended (array-like)
    assert back.request.batch.proximal_logprobs is None
    for name in list(TrainBatch.__struct_fields__)[:6]:
        a, b = getattr(batch, name), getattr(back.request.batch, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert back.request.batch.loss_mask.tolist() == [1, 0, 0, 1]
    refreshed = msgspec.structs.replace(batch, reference_logprobs=np.array([-1, -1, -2, -2], np.float32))
    frames = codec.encode(Call(call_id=10, request=TrainChunk(step=2, batch=refreshed)))
    assert len(frames) == 1 + 7  # a refreshed array travels as one more frame
    back_batch = codec.decode(frames).request.batch
    assert back_batch.proximal_logprobs is None
    assert back_batch.reference_logprobs.tolist() == [-1, -1, -2, -2]
    gen = Cast(request=Generate(requests=[GenRequest(group_id="g", prompt_ids=[1, 2], n=4, max_tokens=8)]))
    assert codec.decode(codec.encode(gen)) == gen


def test_decode_is_zero_copy_view_of_frame() -> None:
    codec = Codec(FromWorker)
    frames = codec.encode(Reply(call_id=1, result=LogprobsResult(logprobs=np.ones(1000, np.float32))))
    payload = bytearray(bytes(frames[1]))
    back = codec.decode([frames[0], memoryview(payload)])
    payload[0:4] = np.float32(7).tobytes()
    assert back.result.logprobs[0] == 7  # a view, not a copy


def test_unknown_objects_are_refused_not_pickled() -> None:
    class Thing:
        pass

    codec = Codec(FromWorker)
    with pytest.raises(TypeError, match="no pickle"):
        codec.encode(Reply(call_id=1, result=LogprobsResult(logprobs=Thing())))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot go on the wire"):
        codec.encode(Reply(call_id=1, result=LogprobsResult(logprobs=np.array(["x"]))))


def test_garbage_and_wrong_tags_raise_protocol_error() -> None:
    codec = Codec(FromWorker)
    with pytest.raises(ProtocolError):
        codec.decode([b"\xc1"])
    with pytest.raises(ProtocolError):
        codec.decode([bytes.fromhex(GOLDEN["sample_done"])])  # a data message on the control codec
    with pytest.raises(ProtocolError, match="frame"):
        codec.decode([bytes.fromhex(GOLDEN["reply_lp"])])  # array frame missing
    with pytest.raises(ProtocolError):
        codec.decode([])
