"""The checkpoint writer that writes around the page cache: the files it writes read back
through DCP's own reader, bit for bit, whichever way each tensor's bytes went out."""

import errno
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
direct = pytest.importorskip("hororing.torch.checkpoint.direct")

pytestmark = [pytest.mark.skipif(not direct.usable(), reason="torch without skip_data"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _state():
    generator = torch.Generator().manual_seed(0)

    def aligned(shape, dtype=torch.float32):
        tensor = direct.aligned_empty(shape, dtype)
        tensor.copy_(torch.randn(shape, generator=generator).to(dtype))
        return tensor

    big = torch.randn(3 * direct.BLOCK + 5, 7, generator=generator)
    return {
        # page-aligned staging memory, sizes that are and are not whole blocks
        "aligned_odd": aligned((1_100_003,)),
        "aligned_blocks": aligned((64 * direct.BLOCK,)),
        "aligned_bf16": aligned((50_000, 3), torch.bfloat16),
        "aligned_small": aligned((3,)),  # (from torch's allocator: too small for a mapping)
        # memory anywhere: through the bounce buffer
        "loose": torch.randn(1_234_567, generator=generator),
        "view": big[1:],  # a view of a larger storage: written as its own tensor
        "strided": big.t(),  # not contiguous
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "ints": torch.arange(-50, 50, dtype=torch.int64),
        "extra": {"step": 17, "name": "run-1", "values": [1.5, None]},
    }


def _reference(state):
    return {key: value.clone() if torch.is_tensor(value) else value
            for key, value in state.items()}


def _read_back(path, like):
    into = {key: torch.full_like(value, 7) if torch.is_tensor(value) else value
            for key, value in like.items()}
    into["extra"] = {key: 0 for key in like["extra"]}
    dcp.load(into, checkpoint_id=str(path), no_dist=True)
    return into


def _equal_bits(got, want):
    assert set(got) == set(want)
    for key, value in want.items():
        if torch.is_tensor(value):
            assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
            assert torch.equal(got[key].reshape(-1).view(torch.uint8),
                               value.contiguous().reshape(-1).view(torch.uint8)), key
        else:
            assert got[key] == value, key


def _save(path, state):
    path.mkdir()
    dcp.save(state, storage_writer=direct.writer(str(path)), no_dist=True)


def test_every_kind_of_tensor_reads_back_bit_for_bit_through_dcps_reader(tmp_path):
    state = _state()
    want = _reference(state)
    _save(tmp_path / "ckpt", state)
    _equal_bits(_read_back(tmp_path / "ckpt", state), want)


def test_the_same_state_saved_by_dcps_own_writer_reads_back_the_same(tmp_path, monkeypatch):
    state = _state()
    _save(tmp_path / "direct", state)
    monkeypatch.setenv("HORORING_CHECKPOINT_WRITER", "filesystem")
    assert type(direct.writer(str(tmp_path))) is dcp.FileSystemWriter
    _save(tmp_path / "filesystem", state)
    _equal_bits(_read_back(tmp_path / "direct", state),
                _read_back(tmp_path / "filesystem", state))


def test_a_plain_torch_load_of_dcp_to_torch_save_gives_the_state(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    state = _state()
    want = _reference(state)
    _save(tmp_path / "ckpt", state)
    dcp_to_torch_save(str(tmp_path / "ckpt"), str(tmp_path / "whole.pt"))
    _equal_bits(torch.load(tmp_path / "whole.pt", weights_only=True), want)


def test_aligned_data_starts_on_a_block_and_the_file_ends_at_its_last_byte(tmp_path):
    state = _state()
    _save(tmp_path / "ckpt", state)
    metadata = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    files = {name for name in os.listdir(tmp_path / "ckpt") if name.endswith(".distcp")}
    assert len(files) == 1
    ends, checked = [], 0
    for index, info in metadata.storage_data.items():
        ends.append(info.offset + info.length)
        value = state.get(index.fqn)
        # written where it lies: contiguous, its storage its own (a view or a strided
        # tensor is written from a copy, wherever the copy lands) and on a block
        if torch.is_tensor(value) and value.is_contiguous() and \
                value.untyped_storage().nbytes() == value.nbytes and \
                value.data_ptr() % direct.BLOCK == 0 and value.nbytes >= direct.BLOCK:
            head, _ = direct._framed(value)
            assert (info.offset + len(head)) % direct.BLOCK == 0, index.fqn
            checked += 1
    assert checked >= 3  # the three aligned ones at least (torch's allocator may align more)
    assert os.path.getsize(tmp_path / "ckpt" / files.pop()) == max(ends)


def test_a_file_system_without_o_direct_gets_the_same_bytes(tmp_path, monkeypatch):
    real_open = os.open

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", refusing)
    state = _state()
    want = _reference(state)
    _save(tmp_path / "ckpt", state)
    _equal_bits(_read_back(tmp_path / "ckpt", state), want)


def test_a_write_refused_midway_goes_on_through_the_page_cache(tmp_path, monkeypatch):
    real_write, refused = os.write, []

    def once_refusing(fd, data):
        if not refused and len(data) >= direct.BLOCK:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "misaligned")
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", once_refusing)
    state = _state()
    want = _reference(state)
    _save(tmp_path / "ckpt", state)
    assert refused
    _equal_bits(_read_back(tmp_path / "ckpt", state), want)


def test_a_layout_it_cannot_split_is_written_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(direct, "_framed", lambda tensor: None)
    state = _state()
    want = _reference(state)
    _save(tmp_path / "ckpt", state)
    _equal_bits(_read_back(tmp_path / "ckpt", state), want)


def test_the_file_buffer_writes_whole_blocks_and_keeps_order(tmp_path):
    data = np.random.default_rng(1).integers(0, 255, 5 * 2**20 + 3, dtype=np.uint8)
    aligned = direct.aligned_empty((direct.ALIGNED_FROM + 11,), torch.uint8)
    assert aligned.data_ptr() % direct.BLOCK == 0
    aligned.copy_(torch.arange(aligned.numel()) % 251)
    with direct._File(str(tmp_path / "f"), True) as out:
        out.put(b"head")
        out.put(data)
        out.pad(5)
        before = out.position
        out.put(b"12345")
        assert out.position % direct.BLOCK == 0
        out.put_aligned(aligned.numpy())
        out.put(b"tail")
    written = (tmp_path / "f").read_bytes()
    assert written[:4] == b"head" and written[4:4 + data.nbytes] == data.tobytes()
    assert written[before:before + 5] == b"12345"
    assert written[before + 5:-4] == aligned.numpy().tobytes()
    assert written[-4:] == b"tail"


def test_a_wrong_writer_name_says_which_names_there_are(monkeypatch):
    monkeypatch.setenv("HORORING_CHECKPOINT_WRITER", "fast")
    with pytest.raises(ValueError, match="HORORING_CHECKPOINT_WRITER='fast'.*'direct'.*"
                                         "'filesystem'"):
        direct.usable()


def test_aligned_empty_starts_on_a_page_and_holds_its_shape():
    shape = (direct.ALIGNED_FROM // 6 + 1, 3)
    tensor = direct.aligned_empty(shape, torch.float16)
    assert tensor.data_ptr() % direct.BLOCK == 0
    assert tensor.shape == shape and tensor.dtype == torch.float16
    assert tensor.untyped_storage().nbytes() == tensor.nbytes
    assert direct.aligned_empty((0, 5), torch.float32).shape == (0, 5)
