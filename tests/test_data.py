"""The training data pipeline: the stdlib corpus, text and .bin files, deterministic batches, the
documents batches carry, errors."""

import array
import sysconfig
import zlib
from pathlib import Path

import pytest
import torch

from fused_remat.training import data as data_module
from fused_remat.training.data import (NO_DOCUMENTS, Batch, TokenData, check_token_ids, load_data, stdlib_split,
                                       train_batch, val_batches)


@pytest.fixture(scope="module")
def stdlib_data() -> TokenData:
    return load_data(None)


def _write_tokens(path: Path, tokens, typecode: str = "H") -> Path:
    """Write ``tokens`` the way nanoGPT's prepare scripts do: a bare array in native byte order."""
    ids = array.array(typecode, tokens)
    path.write_bytes(ids.tobytes())
    return path


def _counting_bin(tmp_path: Path, n_tokens: int) -> TokenData:
    """A .bin whose token at position i is i, so every window shows where it was cut from."""
    return load_data(_write_tokens(tmp_path / "count.bin", range(n_tokens)), vocab_size=n_tokens)


# --- the default corpus ------------------------------------------------------------------------


def test_stdlib_corpus_loads_as_bytes(stdlib_data):
    assert stdlib_data.vocab_size == 256
    for split in (stdlib_data.train, stdlib_data.val):
        assert split.dtype == torch.uint8 and split.dim() == 1
    # Sizes vary with the Python version and distribution; any stdlib has megabytes of sources.
    assert stdlib_data.train.numel() > 2_000_000
    assert stdlib_data.val.numel() > 100_000
    assert stdlib_data.val.numel() < stdlib_data.train.numel()
    assert "stdlib" in stdlib_data.description and "MB" in stdlib_data.description


def test_stdlib_split_is_by_file_name_and_disjoint():
    train_files, val_files = stdlib_split()
    assert train_files == sorted(train_files) and val_files == sorted(val_files)
    assert not set(train_files) & set(val_files)
    assert all(zlib.crc32(p.encode()) % 10 == 0 for p in val_files)
    assert all(zlib.crc32(p.encode()) % 10 != 0 for p in train_files)
    assert 0.03 < len(val_files) / (len(train_files) + len(val_files)) < 0.2
    assert not any("site-packages/" in p or "__pycache__/" in p for p in train_files + val_files)
    assert stdlib_split() == (train_files, val_files)


def test_stdlib_splits_are_their_files_joined_in_path_order(stdlib_data):
    root = Path(sysconfig.get_paths()["stdlib"])
    train_files, val_files = stdlib_split()
    for split, files in ((stdlib_data.train, train_files), (stdlib_data.val, val_files)):
        sizes = [(root / p).stat().st_size for p in files]
        assert split.numel() == sum(sizes) + len(files) - 1  # one b"\n" between neighbours
        first, last = (root / files[0]).read_bytes(), (root / files[-1]).read_bytes()
        assert bytes(split[: len(first)]) == first
        assert bytes(split[split.numel() - len(last) :]) == last


def test_stdlib_loads_the_same_twice(stdlib_data):
    again = load_data(None)
    assert torch.equal(again.train, stdlib_data.train) and torch.equal(again.val, stdlib_data.val)


def test_stdlib_split_walks_only_python_sources(tmp_path):
    for relative in ["a.py", "notes.txt", "pkg/b.py", "pkg/__pycache__/b.py", "site-packages/c.py", "z/d.py"]:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("x = 1\n")
    train_files, val_files = stdlib_split(tmp_path)
    assert sorted(train_files + val_files) == ["a.py", "pkg/b.py", "z/d.py"]


def test_byte_data_accepts_a_larger_vocab_but_not_a_smaller_one(tmp_path):
    assert load_data(None, vocab_size=300).vocab_size == 300
    text = tmp_path / "notes.txt"
    text.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="--vocab-size 100 is too small"):
        load_data(text, vocab_size=100)
    with pytest.raises(ValueError, match="--vocab-size 255 is too small.*default corpus"):
        load_data(None, vocab_size=255)


# --- batches -----------------------------------------------------------------------------------


def test_batches_are_windows_with_targets_shifted_by_one(tmp_path):
    data = _counting_bin(tmp_path, 5000)
    batch = train_batch(data, step=3, micro_step=0, rank=0, batch_size=6, seq_len=32, seed=0)
    inputs, targets = batch.inputs, batch.targets
    assert batch.cu_seqlens is None and batch.max_seqlen is None  # a .bin marks no documents by itself
    assert inputs.shape == targets.shape == (6, 32)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.is_contiguous() and targets.is_contiguous()
    for row in inputs:
        assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 32))
    assert torch.equal(targets, inputs + 1)
    assert int(targets.max()) < data.train.numel()  # cut from the training part only


def test_train_batch_is_a_pure_function_of_seed_step_micro_step_rank(stdlib_data):
    def batch(step=7, micro_step=1, rank=0, seed=1234):
        return train_batch(stdlib_data, step, micro_step, rank, batch_size=4, seq_len=64, seed=seed)

    reference = batch()
    torch.manual_seed(99)  # the global RNG must not matter (a resumed run reseeds it differently)
    batch(step=3)
    again = batch()
    assert torch.equal(again.inputs, reference.inputs) and torch.equal(again.targets, reference.targets)
    assert torch.equal(again.cu_seqlens, reference.cu_seqlens)
    for other in (batch(step=8), batch(micro_step=2), batch(rank=1), batch(seed=1235)):
        assert not torch.equal(other.inputs, reference.inputs)


def test_val_batches_are_fixed_by_the_seed_and_come_from_the_val_split(tmp_path):
    data = _counting_bin(tmp_path, 5000)
    first = list(val_batches(data, n_batches=3, batch_size=4, seq_len=16, seed=5))
    second = list(val_batches(data, n_batches=3, batch_size=4, seq_len=16, seed=5))
    assert len(first) == 3
    for one, two in zip(first, second):
        assert torch.equal(one.inputs, two.inputs) and torch.equal(one.targets, two.targets)
        assert one.inputs.shape == (4, 16) and torch.equal(one.targets, one.inputs + 1)
        assert int(one.inputs.min()) >= data.train.numel()  # token i sits at position i: all in the tail
    assert not torch.equal(first[0].inputs, first[1].inputs)
    other_seed = next(val_batches(data, n_batches=1, batch_size=4, seq_len=16, seed=6))
    assert not torch.equal(other_seed.inputs, first[0].inputs)


def test_a_split_exactly_one_sequence_long_works(tmp_path):
    data = _counting_bin(tmp_path, 100)  # val is the last 10 tokens
    batch = next(val_batches(data, n_batches=1, batch_size=2, seq_len=9, seed=0))
    assert torch.equal(batch.inputs[0], torch.arange(90, 99)) and torch.equal(batch.targets[1], torch.arange(91, 100))


# --- documents ---------------------------------------------------------------------------------


def _check_offsets(batch: Batch) -> list[int]:
    """``batch``'s cu_seqlens as a list, after checking what the model needs of them."""
    rows, seq_len = batch.inputs.shape
    offsets = batch.cu_seqlens.tolist()
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.dim() == 1
    assert offsets[0] == 0 and offsets[-1] == rows * seq_len
    assert all(a < b for a, b in zip(offsets, offsets[1:]))  # increasing: no empty segment either
    assert {row * seq_len for row in range(rows)} <= set(offsets)  # no segment crosses rows
    assert batch.max_seqlen == max(b - a for a, b in zip(offsets, offsets[1:]))
    return offsets


def _old_cut(tokens: torch.Tensor, generator: torch.Generator, batch_size: int, seq_len: int):
    """The batch as it was cut before batches carried documents."""
    offsets = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
    windows = torch.stack([tokens[o : o + seq_len + 1].to(torch.int64) for o in offsets.tolist()])
    return windows[:, :-1], windows[:, 1:]


def test_stdlib_documents_start_at_its_files(stdlib_data):
    root = Path(sysconfig.get_paths()["stdlib"])
    for split, starts, files in ((stdlib_data.train, stdlib_data.train_document_starts, stdlib_split()[0]),
                                 (stdlib_data.val, stdlib_data.val_document_starts, stdlib_split()[1])):
        sizes = [(root / p).stat().st_size for p in files]
        expected = [sum(sizes[:i]) + i for i in range(len(files))]  # each file follows a b"\n"
        assert starts.dtype == torch.int64 and starts.tolist() == expected
        assert bytes(split[starts[-1] :]) == (root / files[-1]).read_bytes()
    assert stdlib_data.documents == "each source file"


def test_documents_leave_the_tokens_as_they_were_cut_before(stdlib_data):
    whole_rows = load_data(None, document_boundary=NO_DOCUMENTS)
    assert whole_rows.documents == NO_DOCUMENTS and whole_rows.description == stdlib_data.description
    batch_size, seq_len, crossing = 8, 2048, 0
    for step in range(3):
        batch = train_batch(stdlib_data, step, 1, 2, batch_size, seq_len, seed=11)
        generator = data_module._seeded_generator("train", 11, step, 1, 2)
        inputs, targets = _old_cut(stdlib_data.train, generator, batch_size, seq_len)
        assert torch.equal(batch.inputs, inputs) and torch.equal(batch.targets, targets)
        crossing += len(_check_offsets(batch)) - 1 - batch_size
        plain = train_batch(whole_rows, step, 1, 2, batch_size, seq_len, seed=11)
        assert torch.equal(plain.inputs, inputs) and plain.cu_seqlens is None and plain.max_seqlen is None
    assert crossing > 0  # most stdlib files are shorter than 2048 bytes: some rows hold several
    validation = next(val_batches(stdlib_data, 1, batch_size, seq_len, seed=11))
    inputs, _ = _old_cut(stdlib_data.val, data_module._seeded_generator("val", 11, 0), batch_size, seq_len)
    assert torch.equal(validation.inputs, inputs)
    _check_offsets(validation)


def test_known_document_starts_cut_each_row_where_a_document_begins_in_it():
    tokens = torch.arange(1000, dtype=torch.int32).to(torch.uint16)  # token i at position i shows the offset
    starts = torch.tensor([0, 100, 101, 250, 600, 990])
    data = TokenData(tokens, tokens, 1000, "counting", "counting train", "counting val", starts, starts)
    batch = train_batch(data, 0, 0, 0, batch_size=16, seq_len=120, seed=3)
    offsets = _check_offsets(batch)
    expected = [0]
    for row, first in enumerate(batch.inputs[:, 0].tolist()):
        expected += [row * 120 + s - first for s in starts.tolist() if first < s < first + 120] + [(row + 1) * 120]
    assert offsets == expected


def test_bin_documents_begin_at_the_boundary_token_and_at_every_row(tmp_path):
    boundary = 5
    _write_tokens(tmp_path / "train.bin", [(i * 7) % 13 for i in range(3000)])
    _write_tokens(tmp_path / "val.bin", [5, 1, 2, 5, 3, 5, 4, 4, 4])  # one window: seq_len 8 + 1 target
    data = load_data(tmp_path / "train.bin", vocab_size=13, document_boundary=boundary)
    assert data.documents == "each token 5"
    batch = next(val_batches(data, n_batches=1, batch_size=2, seq_len=8, seed=0))
    # Documents begin at the boundary tokens (positions 0, 3, 5) and at each row's start.
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8, 11, 13, 16] and batch.max_seqlen == 3

    batch = train_batch(data, 4, 0, 0, batch_size=4, seq_len=40, seed=0)
    expected = [row * 40 + column for row, tokens in enumerate(batch.inputs.tolist())
                for column, token in enumerate(tokens) if column == 0 or token == boundary]
    assert _check_offsets(batch) == expected + [4 * 40]
    assert len(expected) > 4


def test_text_documents_begin_at_the_boundary_byte(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_bytes(b"".join(b"|document %d says hello" % i for i in range(200)))
    data = load_data(text, document_boundary=ord("|"))
    batch = train_batch(data, 0, 0, 0, batch_size=3, seq_len=64, seed=0)
    offsets = _check_offsets(batch)
    for row in range(3):
        cuts = [offset - row * 64 for offset in offsets if row * 64 < offset < (row + 1) * 64]
        assert cuts == [column for column in range(1, 64) if batch.inputs[row, column] == ord("|")] and cuts


def test_causal_attention_pairs_count_each_segment():
    inputs = torch.zeros(2, 4, dtype=torch.int64)
    assert Batch(inputs, inputs).causal_attention_pairs() == 2 * 10
    offsets = torch.tensor([0, 1, 4, 6, 8], dtype=torch.int32)
    assert Batch(inputs, inputs, offsets, 3).causal_attention_pairs() == 1 + 6 + 3 + 3


@pytest.mark.parametrize("source, boundary, message", [
    (None, 10, "--document-boundary 10: the default corpus's documents are its source files"),
    ("tokens.bin", 1000, "--document-boundary 1,000 is not a token id: --vocab-size is 1,000"),
    ("notes.txt", 256, "--document-boundary 256: text is read as bytes, so a boundary is a byte value 0..255"),
    ("tokens.bin", -1, "--document-boundary must be a token id >= 0 or none, got -1"),
])
def test_a_boundary_that_cannot_occur_is_refused(tmp_path, source, boundary, message):
    _write_tokens(tmp_path / "tokens.bin", range(1000))
    (tmp_path / "notes.txt").write_text("some text\n" * 100)
    with pytest.raises(ValueError, match=message):
        load_data(None if source is None else tmp_path / source, vocab_size=1000 if source == "tokens.bin" else None,
                  document_boundary=boundary)


# --- text files --------------------------------------------------------------------------------


def test_text_file_holds_out_its_last_tenth(tmp_path):
    text = tmp_path / "notes.txt"
    content = (bytes(range(32, 127)) * 11)[:1024]  # 1024 bytes of printable text
    text.write_bytes(content)
    data = load_data(text)
    assert data.vocab_size == 256 and data.train.dtype == torch.uint8
    assert bytes(data.train) == content[:922] and bytes(data.val) == content[922:]
    assert str(text) in data.description


def test_text_holdout_grows_to_one_sequence_when_seq_len_is_given(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_bytes(b"a" * 1000)
    data = load_data(text, seq_len=199)
    assert data.val.numel() == 200 and data.train.numel() == 800


def test_file_too_short_for_two_sequences(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_bytes(b"a" * 300)
    with pytest.raises(ValueError, match=r"first 99 tokens.*has 99 tokens.*--seq-len 200 needs at least 201"):
        load_data(text, seq_len=200)


# --- pre-tokenized .bin files ------------------------------------------------------------------


def test_bin_uint16_round_trip_holds_out_the_tail(tmp_path):
    tokens = [(i * 7919) % 50257 for i in range(2000)]
    data = load_data(_write_tokens(tmp_path / "tokens.bin", tokens), vocab_size=50257)
    assert data.train.dtype == data.val.dtype == torch.uint16
    assert data.train.to(torch.int64).tolist() == tokens[:1800]
    assert data.val.to(torch.int64).tolist() == tokens[1800:]
    assert "uint16" in data.description and "50,257" in data.description


def test_train_bin_uses_its_sibling_val_bin(tmp_path):
    _write_tokens(tmp_path / "train.bin", [1, 2, 3] * 100)
    _write_tokens(tmp_path / "val.bin", [4, 5] * 50)
    for path in (tmp_path / "train.bin", tmp_path):  # the file and the directory forms
        data = load_data(path, vocab_size=6)
        assert data.train.to(torch.int64).tolist() == [1, 2, 3] * 100
        assert data.val.to(torch.int64).tolist() == [4, 5] * 50
        assert data.val_source == str(tmp_path / "val.bin")


def test_directory_without_val_bin_holds_out_the_tail_of_train_bin(tmp_path):
    _write_tokens(tmp_path / "train.bin", range(1000))
    data = load_data(tmp_path, vocab_size=1000)
    assert data.train.numel() == 900 and data.val.to(torch.int64).tolist() == list(range(900, 1000))


def test_bin_uses_uint32_ids_above_65536(tmp_path):
    tokens = [70_000 + i for i in range(100)] + [5, 65_536, 99_999]
    data = load_data(_write_tokens(tmp_path / "big_vocab.bin", tokens, typecode="I"), vocab_size=100_000)
    assert data.train.dtype == torch.uint32
    assert data.train.to(torch.int64).tolist() + data.val.to(torch.int64).tolist() == tokens
    assert int(train_batch(data, 0, 0, 0, batch_size=2, seq_len=8, seed=0).inputs.min()) >= 70_000


def test_token_id_out_of_vocab_is_found_when_loading_with_file_and_offset(tmp_path):
    _write_tokens(tmp_path / "train.bin", [7] * 200)
    _write_tokens(tmp_path / "val.bin", [7] * 50 + [2000] * 50)
    with pytest.raises(ValueError, match=r"val\.bin holds token id 2,000 at token offset 50 \(byte offset 100\)"
                                         r".*--vocab-size is 1,000"):
        load_data(tmp_path / "train.bin", vocab_size=1000)
    (tmp_path / "val.bin").unlink()
    _write_tokens(tmp_path / "train.bin", [7] * 100_000 + [70_500, 80_000] + [7] * 10, typecode="I")
    with pytest.raises(ValueError, match=r"train\.bin holds token id 70,500 at token offset 100,000 \(byte offset 400,000\)"):
        load_data(tmp_path / "train.bin", vocab_size=70_000)


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_token_ids_are_checked_chunk_by_chunk_to_the_first_bad_one(chunk):
    ids = torch.full((50,), 9, dtype=torch.int32)
    ids[[21, 22, 40]] = torch.tensor([10, 11, 12], dtype=torch.int32)
    tokens = ids.to(torch.uint16)
    check_token_ids(tokens, 13, "ok.bin", chunk=chunk)
    with pytest.raises(ValueError, match=r"bad\.bin holds token id 10 at token offset 21 \(byte offset 42\)"):
        check_token_ids(tokens, 10, "bad.bin", chunk=chunk)


def test_token_ids_of_a_corrupt_batch_are_still_refused_when_cut():
    tokens = torch.tensor([5] * 40, dtype=torch.uint16)
    data = TokenData(tokens, tokens, 4, "hand-made", "hand-made train", "hand-made val")
    with pytest.raises(ValueError, match=r"hand-made train holds token id 5.*--vocab-size is 4"):
        train_batch(data, 0, 0, 0, batch_size=2, seq_len=8, seed=0)


@pytest.mark.parametrize("content", [b"PK\x03\x04" + bytes(range(256)) * 8, bytes(range(1, 32)) * 40])
def test_a_binary_file_is_not_trained_on_as_text(tmp_path, content):
    path = tmp_path / "corpus.dat"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"corpus\.dat does not look like text.*\.bin and --vocab-size"):
        load_data(path)
    path.write_text("Plain text with tabs\tand\r\nline ends, \x1b[1mANSI\x1b[0m and unicode: \u00e9\u4e2d.\n" * 20)
    assert load_data(path).train.numel() > 0


# --- errors ------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data: .*nowhere.txt not found"):
        load_data(tmp_path / "nowhere.txt")


def test_directory_without_train_bin(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no train.bin"):
        load_data(tmp_path, vocab_size=100)


@pytest.mark.parametrize("name, vocab_size", [("empty.txt", None), ("empty.bin", 100)])
def test_empty_file(tmp_path, name, vocab_size):
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match="--data: .* is empty"):
        load_data(tmp_path / name, vocab_size=vocab_size)


def test_bin_without_vocab_size(tmp_path):
    with pytest.raises(ValueError, match="pass --vocab-size"):
        load_data(_write_tokens(tmp_path / "tokens.bin", range(100)))


@pytest.mark.parametrize("n_bytes, vocab_size, width", [(301, 50257, 2), (302, 100_000, 4)])
def test_bin_size_not_a_multiple_of_the_token_width(tmp_path, n_bytes, vocab_size, width):
    (tmp_path / "tokens.bin").write_bytes(b"\0" * n_bytes)
    with pytest.raises(ValueError, match=f"{n_bytes} bytes, not a multiple of {width}"):
        load_data(tmp_path / "tokens.bin", vocab_size=vocab_size)


def test_vocab_size_must_fit_token_ids_and_be_positive(tmp_path):
    path = _write_tokens(tmp_path / "tokens.bin", range(100))
    with pytest.raises(ValueError, match="larger than uint32"):
        load_data(path, vocab_size=2**32 + 1)
    with pytest.raises(ValueError, match="--vocab-size must be positive"):
        load_data(path, vocab_size=0)


def test_split_too_short_for_the_sequence_length(tmp_path):
    data = _counting_bin(tmp_path, 1000)  # 900 train, 100 val tokens
    with pytest.raises(ValueError, match=r"has 900 tokens, but --seq-len 900 needs at least 901"):
        train_batch(data, 0, 0, 0, batch_size=1, seq_len=900, seed=0)
    with pytest.raises(ValueError, match=r"held out for validation\) has 100 tokens.*needs at least 101"):
        val_batches(data, n_batches=1, batch_size=1, seq_len=100, seed=0)  # raises at the call, not lazily


@pytest.mark.parametrize(
    "batch_size, seq_len, n_batches, argument",
    [(0, 8, 1, "--batch-size"), (-1, 8, 1, "--batch-size"), (2, 0, 1, "--seq-len"), (2, 8, 0, "n_batches")],
)
def test_non_positive_batch_arguments(tmp_path, batch_size, seq_len, n_batches, argument):
    data = _counting_bin(tmp_path, 1000)
    with pytest.raises(ValueError, match=f"{argument} must be positive"):
        val_batches(data, n_batches, batch_size, seq_len, seed=0)
    if argument != "n_batches":
        with pytest.raises(ValueError, match=f"{argument} must be positive"):
            train_batch(data, 0, 0, 0, batch_size, seq_len, seed=0)


def test_load_data_rejects_a_non_positive_seq_len(tmp_path):
    with pytest.raises(ValueError, match="--seq-len must be positive"):
        load_data(_write_tokens(tmp_path / "tokens.bin", range(100)), vocab_size=100, seq_len=0)
