"""Inline tensor encoding (the bytes embedded in control messages). A failure means a tensor arrives changed
(values, dtype, shape) when it rides inside a message, or a bad message decodes silently."""

import msgspec
import pytest
import torch

from mstar_dist.control.messages import InlineTensor
from mstar_dist.transport.inline import decode_ids, decode_tensor, dtype_to_str, encode_ids, encode_tensor, str_to_dtype

CASES = [
    torch.randn(3, 4),
    torch.randn(5, dtype=torch.float64),
    torch.randn(2, 3).to(torch.float16),
    torch.randn(2, 3).to(torch.bfloat16),
    torch.tensor([True, False, True]),
    torch.arange(-5, 5, dtype=torch.int64),
    torch.arange(-5, 5, dtype=torch.int8),
    torch.arange(10, dtype=torch.uint8).reshape(2, 5),
    torch.tensor(3.5),  # 0-d
    torch.tensor(7, dtype=torch.int64),  # 0-d int
    torch.empty(0, 4),  # empty
    torch.empty(0, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("t", CASES, ids=lambda t: f"{dtype_to_str(t.dtype)}{list(t.shape)}")
def test_roundtrip_through_msgpack(t):
    it = encode_tensor(t)
    wire = msgspec.msgpack.encode(it)
    back = decode_tensor(msgspec.msgpack.decode(wire, type=InlineTensor))
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back, t)


@pytest.mark.parametrize("ids", [[1, 2, 49151], [0], [], [-(1 << 63), (1 << 63) - 1]], ids=len)
def test_prompt_ids_encoded_from_ints_are_what_the_tensor_path_sends(ids):
    """A prompt goes on the wire straight from its ints (``encode_ids``, the conductor's path for every request): the
    rank must decode exactly the int64 tensor the tensor path would have sent."""
    it = encode_ids(ids)
    assert it == encode_tensor(torch.tensor(ids, dtype=torch.int64))
    back = decode_tensor(msgspec.msgpack.decode(msgspec.msgpack.encode(it), type=InlineTensor))
    assert back.dtype == torch.int64 and back.tolist() == ids


def test_prompt_id_outside_int64_is_refused():
    with pytest.raises(OverflowError):
        encode_ids([1 << 63])


def test_bfloat16_bits_are_exact():
    t = torch.tensor([1.0, -0.0, float("inf"), 3.140625, 1e-30]).to(torch.bfloat16)
    back = decode_tensor(encode_tensor(t))
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


def test_non_contiguous_inputs():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for t in (base.t(), base[:, ::2], base[1:3, 2:5], base.expand(2, 4, 6)):
        assert not t.is_contiguous()
        back = decode_tensor(encode_tensor(t))
        assert back.shape == t.shape and torch.equal(back, t)
        assert back.is_contiguous()


def test_decoded_tensor_is_writable_and_independent():
    it = encode_tensor(torch.zeros(3))
    a = decode_tensor(it)
    a += 1
    assert torch.equal(decode_tensor(it), torch.zeros(3))


def test_wrong_byte_count_is_rejected():
    it = InlineTensor(dtype="float32", shape=[2, 2], data=b"\x00" * 12)
    with pytest.raises(ValueError, match="12 bytes"):
        decode_tensor(it)


def test_dtype_names():
    assert dtype_to_str(torch.bfloat16) == "bfloat16"
    assert str_to_dtype("bool") is torch.bool
    with pytest.raises(ValueError, match="float128"):
        str_to_dtype("float128")


def test_token_ids_read_back_as_ints_without_a_tensor():
    """``decode_ids`` (the conductor's path for a decode step's tokens) gives the ints the tensor path would, across
    values, and refuses what is not int64."""
    values = [encode_tensor(torch.tensor([5])), encode_ids([7, -3]), encode_tensor(torch.tensor([[1, 2]]))]
    assert decode_ids(values) == [5, 7, -3, 1, 2]
    with pytest.raises(ValueError, match="int64 values only"):
        decode_ids([encode_tensor(torch.tensor([1.0]))])
