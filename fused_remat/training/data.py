"""Training data for the language-model trainer: where the tokens come from and how batches are cut.

`load_data(path, vocab_size)` understands three sources:

* ``path=None``: the default corpus, present on every machine without a download: the ``.py``
  sources of the running Python's standard library, read as bytes (vocabulary 256). A file goes to
  the validation split when ``zlib.crc32(<its path relative to the stdlib, posix form>) % 10 == 0``,
  so a file's split depends only on its own name, not on which other files a machine has or the
  order a directory lists them in. Each split is its files in sorted path order, joined by b"\\n".
  ``site-packages``, ``dist-packages`` and ``__pycache__`` are skipped: they are not the stdlib.
* a text file (any path that is neither a directory nor ends in ``.bin``): its bytes (vocabulary
  256). The last 10% of the file is held out for validation.
* nanoGPT-style pre-tokenized data: a flat array of token ids in native byte order with no header,
  uint16 when ``vocab_size <= 65536`` and uint32 above. The file does not record its vocabulary, so
  ``vocab_size`` is required. The path is a directory holding ``train.bin`` (and optionally
  ``val.bin``), a file named ``train.bin`` (a sibling ``val.bin``, if there is one, is the
  validation split) or any other ``.bin`` file. Without a ``val.bin`` the last 10% of the tokens
  are held out. These files are memory-mapped, never read whole: they can be larger than RAM.

Batches are ``Batch(inputs, targets, cu_seqlens, max_seqlen)``: int64 inputs and targets of shape
``(batch_size, seq_len)`` cut at random offsets, the targets being the inputs shifted by one token.
The offsets of a training batch are a pure function of ``(seed, step, micro_step, rank)``: a run
resumed at step k draws exactly the batches an uninterrupted run would have, and data-parallel
ranks draw different ones. The trainer passes ``micro_step`` 0 and, as ``rank``, the micro-batch's
slot in its step (``loop.micro_batch_slot``: rank x grad_accum + micro-step), so that a step's global
batch is the same sequences on any world with as many micro-batches per step. Validation batches
depend only on the seed, so every evaluation scores the same tokens.

Documents (``document_boundary``, the trainer's ``--document-boundary``). Where the data says where
documents start, a batch also carries them, so that attention stays within each: ``cu_seqlens``,
the int32 offsets of its segments over the flattened ``batch_size * seq_len`` inputs, and
``max_seqlen``, the longest. A segment begins at the start of every row and at every document
start inside a row, so no segment crosses rows. Documents do not change the tokens: the inputs and
targets are those of a batch without them. Where documents start:

* the default corpus: at each source file (the b"\\n" that joins two files ends the first); the
  splits record their files' start offsets.
* text and ``.bin`` data: at each occurrence of the boundary token given as ``document_boundary``
  (a byte value for text, a token id below ``vocab_size`` for ``.bin``). The boundary token is the
  first token of the document it begins, as a BOS token is; with nanoGPT-style data, where an
  end-of-text token follows each document, that token then opens the next one. Boundaries are
  found in each window as it is cut, never by scanning a whole (memory-mapped) file. Without a
  boundary token these have no documents.
* ``document_boundary="none"``: no documents for any source; attention spans whole rows.

Errors name the command-line argument they are about (``--data``, ``--vocab-size``, ``--seq-len``,
``--batch-size``, ``--document-boundary``) because the trainer passes its arguments through unchanged.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..kernels.limits import check_documents

if TYPE_CHECKING:
    from ..context_parallel_documents import DocumentShards

BYTE_VOCAB_SIZE = 256
NO_DOCUMENTS = "none"  # document_boundary: attention spans whole rows, whatever the data marks
_UINT16_VOCAB_LIMIT = 2**16
_UINT32_VOCAB_LIMIT = 2**32
_HELD_OUT_DIVISOR = 10  # a single file keeps its last 1/10 for validation
_STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_STDLIB_FILE_SEPARATOR = b"\n"
_VALIDATION_CHUNK = 1 << 24  # token ids checked per piece of a memory-mapped file (32-64 MiB)
_FINGERPRINT_BLOCKS = 64  # blocks of each split a data fingerprint hashes
_FINGERPRINT_BLOCK = 4096  # tokens a block
_TEXT_SAMPLE = 1 << 16  # bytes of a text file looked at to tell it from a binary one
# Bytes that do not occur in text: the C0 controls but tab, newline, vertical tab, form feed,
# carriage return and escape.
_BINARY_BYTES = frozenset(range(32)) - {9, 10, 11, 12, 13, 27}


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors with == gives a tensor, not a bool
class TokenData:
    """The token ids of a training and a validation split.

    ``train`` and ``val`` are 1-D uint8 (bytes), uint16 or uint32 tensors, possibly memory-mapped
    views of a file. ``vocab_size`` is the model's vocabulary: every id is below it. ``train_source``
    and ``val_source`` say where each split comes from, for error messages. Documents (module
    docstring): ``train_document_starts`` and ``val_document_starts``, sorted int64 positions where
    a document of the split starts (the default corpus), or ``document_boundary``, the token that
    begins each document; neither when batches carry no documents.
    """

    train: torch.Tensor = field(repr=False)
    val: torch.Tensor = field(repr=False)
    vocab_size: int
    description: str
    train_source: str
    val_source: str
    train_document_starts: torch.Tensor | None = field(default=None, repr=False)
    val_document_starts: torch.Tensor | None = field(default=None, repr=False)
    document_boundary: int | None = None
    mapped_files: tuple = ()  # (path, identity) of each memory-mapped file, see check_files_unchanged

    def check_files_unchanged(self) -> None:
        """A ValueError naming --data if a memory-mapped file was truncated, replaced or rewritten
        since it was loaded: reading a page past a truncated file's end kills the process with
        SIGBUS, and new content would silently change the run. Checked before every step's batches
        (one stat per file), so the loop can still checkpoint the last finished step."""
        for path, identity in self.mapped_files:
            try:
                now = _identity(Path(path))
            except OSError as error:
                raise ValueError(f"--data: {path} can no longer be read ({error.strerror}); restore it and --resume")
            if now != identity:
                size, now_size = identity[0], now[0]
                what = f"its size went from {size:,} to {now_size:,} bytes" if now_size != size else "it was rewritten"
                raise ValueError(f"--data: {path} changed during the run ({what}); restore it and --resume")

    @property
    def documents(self) -> str:
        """Where documents begin, as a run's settings record it: "each source file", "each token <id>"
        or "none"."""
        if self.train_document_starts is not None:
            return "each source file"
        if self.document_boundary is not None:
            return f"each token {self.document_boundary}"
        return NO_DOCUMENTS

    def fingerprint(self) -> str:
        """What a resumed run must find again: the splits' sizes and a hash of their contents, not
        where they live (the same file at another path resumes; another file of the same name does
        not). The hash reads FINGERPRINT_BLOCKS evenly spaced blocks of each split, so its cost does
        not grow with the file, even one larger than memory."""
        digest = hashlib.sha256()
        for split in (self.train, self.val):
            digest.update(f"{split.numel()}:{split.dtype}".encode())
            block = min(_FINGERPRINT_BLOCK, split.numel())
            stride = max(1, (split.numel() - block) // max(1, _FINGERPRINT_BLOCKS - 1))
            for start in range(0, split.numel() - block + 1, stride)[:_FINGERPRINT_BLOCKS]:
                digest.update(split[start:start + block].contiguous().view(torch.uint8).numpy().tobytes())
        return (f"{self.train.numel():,} train / {self.val.numel():,} val tokens, vocab {self.vocab_size:,}, "
                f"sampled sha256 {digest.hexdigest()[:16]}")


@dataclass(frozen=True, eq=False)
class Batch:
    """One batch: int64 ``inputs`` and ``targets`` (batch_size, seq_len) and, when the data marks
    documents, their segments (module docstring): ``cu_seqlens`` int32 offsets over the flattened
    inputs, ``max_seqlen`` the longest segment. ``LanguageModel(inputs, targets, cu_seqlens=,
    max_seqlen=)`` takes them as they are."""

    inputs: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    # under context parallelism: this rank's share of the documents (``loop.local_batch``), which
    # then replaces cu_seqlens and max_seqlen
    documents: DocumentShards | None = None

    def to(self, device: torch.device | str) -> Batch:
        """The batch on ``device``. Offsets in host memory are checked here, from their values, and
        their copy is marked checked with them (``check_documents``): the model, and a graphed step
        that pads them, then need not read them back from the device, a wait for the GPU each step."""
        inputs = self.inputs.to(device)
        cu_seqlens = None if self.cu_seqlens is None else self.cu_seqlens.to(device)
        if cu_seqlens is not None and self.cu_seqlens.device.type == "cpu":
            check_documents("Batch", cu_seqlens, inputs.numel(), inputs.device, self.max_seqlen,
                            offsets=self.cu_seqlens.tolist())
        documents = None if self.documents is None else self.documents.to(device)
        return Batch(inputs, self.targets.to(device), cu_seqlens, self.max_seqlen, documents)

    def causal_attention_pairs(self) -> int:
        """The (query, key) pairs causal attention scores: n (n + 1) / 2 summed over the segments
        of n tokens (the rows, without documents)."""
        if self.cu_seqlens is None:
            rows, seq_len = self.inputs.shape
            return rows * seq_len * (seq_len + 1) // 2
        lengths = self.cu_seqlens.diff().to(torch.int64)
        return int((lengths * (lengths + 1) // 2).sum())


def load_data(path: str | os.PathLike | None, vocab_size: int | None = None, seq_len: int | None = None,
              document_boundary: int | str | None = None) -> TokenData:
    """Load the training and validation tokens named by ``--data`` (see the module docstring).

    ``vocab_size`` (``--vocab-size``) is required for ``.bin`` data; for byte data it defaults to
    256 and may be larger (the model then has unused embedding rows), never smaller. Given
    ``seq_len``, the held-out tail of a single file is made at least one sequence long and both
    splits are checked to hold a sequence, so a too-short file fails here rather than at the
    first batch. ``document_boundary`` (``--document-boundary``): None for the documents the data
    marks itself (the default corpus's files; none in text and ``.bin`` data), the token id that
    begins each document of text or ``.bin`` data, or ``NO_DOCUMENTS``.
    """
    if vocab_size is not None:
        _require_positive("--vocab-size", vocab_size)
    if seq_len is not None:
        _require_positive("--seq-len", seq_len)
    if path is None:
        data = _load_stdlib_sources(_byte_vocab_size(vocab_size, "the default corpus (Python sources)"))
    else:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"--data: {path} not found")
        if path.is_dir() or path.suffix.lower() == ".bin":
            data = _load_token_files(path, vocab_size, seq_len)
        else:
            data = _load_text(path, _byte_vocab_size(vocab_size, f"the text file {path}"), seq_len)
    data = _with_documents(data, document_boundary)
    if seq_len is not None:
        _require_one_sequence(data.train, data.train_source, seq_len)
        _require_one_sequence(data.val, data.val_source, seq_len)
    return data


def _with_documents(data: TokenData, document_boundary: int | str | None) -> TokenData:
    """``data`` with the documents that ``document_boundary`` asks for (load_data)."""
    if document_boundary is None:
        return data
    if document_boundary == NO_DOCUMENTS:
        return replace(data, train_document_starts=None, val_document_starts=None)
    if not isinstance(document_boundary, int) or document_boundary < 0:
        raise ValueError(f"--document-boundary must be a token id >= 0 or {NO_DOCUMENTS}, got {document_boundary!r}")
    if data.train_document_starts is not None:
        raise ValueError(f"--document-boundary {document_boundary}: the default corpus's documents are its source "
                         f"files; a boundary token is for --data (text or .bin), and {NO_DOCUMENTS} turns document "
                         "masking off")
    if data.train.dtype == torch.uint8 and document_boundary >= BYTE_VOCAB_SIZE:
        raise ValueError(f"--document-boundary {document_boundary}: text is read as bytes, so a boundary is a "
                         f"byte value 0..{BYTE_VOCAB_SIZE - 1}")
    if document_boundary >= data.vocab_size:
        raise ValueError(f"--document-boundary {document_boundary:,} is not a token id: --vocab-size is "
                         f"{data.vocab_size:,}, and ids are below it")
    return replace(data, document_boundary=document_boundary)


def train_batch(
    data: TokenData, step: int, micro_step: int, rank: int, batch_size: int, seq_len: int, seed: int
) -> Batch:
    """The training batch of ``(step, micro_step, rank)``: inputs and targets (batch_size, seq_len),
    with their documents where ``data`` has them.

    The same arguments give the same batch in any process, whatever else has been drawn before and
    whatever the global torch RNG state is.
    """
    _require_batch_shape(batch_size, seq_len)
    _require_one_sequence(data.train, data.train_source, seq_len)
    generator = _seeded_generator("train", seed, step, micro_step, rank)
    return _cut_batch(data.train, data.train_source, data.vocab_size, batch_size, seq_len, generator,
                      data.train_document_starts, data.document_boundary)


def val_batches(
    data: TokenData, n_batches: int, batch_size: int, seq_len: int, seed: int
) -> Iterator[Batch]:
    """The ``n_batches`` validation batches of ``seed``, cut from the validation split.

    Every call yields the same batches, so successive evaluations are comparable. Arguments are
    checked at the call, not at the first batch; the batches are cut lazily, one at a time.
    """
    _require_positive("n_batches", n_batches)
    _require_batch_shape(batch_size, seq_len)
    _require_one_sequence(data.val, data.val_source, seq_len)
    return (
        _cut_batch(
            data.val, data.val_source, data.vocab_size, batch_size, seq_len, _seeded_generator("val", seed, index),
            data.val_document_starts, data.document_boundary,
        )
        for index in range(n_batches)
    )


def stdlib_split(root: str | os.PathLike | None = None) -> tuple[list[str], list[str]]:
    """The ``.py`` files under ``root`` (default: this Python's stdlib) as (train, validation) lists.

    Paths are relative to ``root`` in posix form, sorted; this is the file split of the default corpus.
    """
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    paths = []
    for directory, subdirectories, filenames in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in _STDLIB_SKIPPED_DIRS]
        relative_directory = Path(directory).relative_to(root)
        paths.extend((relative_directory / name).as_posix() for name in filenames if name.endswith(".py"))
    paths.sort()  # os.walk order depends on the file system; the split and the concatenation must not
    train = [p for p in paths if not _is_validation_file(p)]
    val = [p for p in paths if _is_validation_file(p)]
    return train, val


def _is_validation_file(relative_posix_path: str) -> bool:
    return zlib.crc32(os.fsencode(relative_posix_path)) % _HELD_OUT_DIVISOR == 0


def _load_stdlib_sources(vocab_size: int) -> TokenData:
    root = Path(sysconfig.get_paths()["stdlib"])
    train_files, val_files = stdlib_split(root)
    if not train_files or not val_files:
        raise FileNotFoundError(
            f"--data: no Python sources under {root} to build the default corpus from; pass --data PATH"
        )
    train, train_starts = _concatenate_files(root, train_files)
    val, val_starts = _concatenate_files(root, val_files)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    description = (
        f"Python {python} stdlib sources ({root}), {len(train_files) + len(val_files):,} files: "
        f"{train.numel() / 1e6:.1f} MB train / {val.numel() / 1e6:.1f} MB val, byte-level"
    )
    corpus = f"the Python stdlib corpus ({root})"
    return TokenData(train, val, vocab_size, description, f"the training files of {corpus}",
                     f"the validation files of {corpus}", train_starts, val_starts)


def _concatenate_files(root: Path, relative_paths: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The files joined by the separator, and where each starts (int64)."""
    contents = [(root / p).read_bytes() for p in relative_paths]
    # bytearray.join makes the one copy; frombuffer then shares it (and needs it writable).
    joined = bytearray(_STDLIB_FILE_SEPARATOR).join(contents)
    spans = torch.tensor([0] + [len(content) + len(_STDLIB_FILE_SEPARATOR) for content in contents[:-1]])
    return torch.frombuffer(joined, dtype=torch.uint8), spans.cumsum(0)


def _load_text(path: Path, vocab_size: int, seq_len: int | None) -> TokenData:
    _require_text(path)
    tokens = _map_tokens(path, torch.uint8, vocab_size)
    train, val, train_source, val_source = _hold_out_tail(tokens, path, seq_len)
    description = (
        f"{path}: {tokens.numel():,} bytes of text, {train.numel():,} train / {val.numel():,} val (the tail), "
        "byte-level"
    )
    return TokenData(train, val, vocab_size, description, train_source, val_source, mapped_files=_identities(path))


def _require_text(path: Path) -> None:
    """ValueError unless ``path`` looks like text: no NUL byte and few other control bytes in its
    first and last 64 KiB (a compressed, pickled or pre-tokenized file has many)."""
    size = path.stat().st_size
    with open(path, "rb") as stream:
        sample = stream.read(_TEXT_SAMPLE)
        if size > 2 * _TEXT_SAMPLE:
            stream.seek(size - _TEXT_SAMPLE)
            sample += stream.read(_TEXT_SAMPLE)
    control = sum(sample.count(bytes([b])) for b in _BINARY_BYTES)
    if b"\0" in sample or control > len(sample) // 100:
        nul = sample.find(b"\0")
        found = f"a NUL byte at offset {nul:,}" if 0 <= nul < _TEXT_SAMPLE else f"{control:,} control bytes"
        raise ValueError(
            f"--data: {path} does not look like text ({found} in its first and last 64 KiB); a text file is "
            "trained on as bytes. Pre-tokenized ids need a name ending in .bin and --vocab-size"
        )


def _load_token_files(path: Path, vocab_size: int | None, seq_len: int | None) -> TokenData:
    if path.is_dir():
        train_file = path / "train.bin"
        if not train_file.is_file():
            raise FileNotFoundError(f"--data: directory {path} has no train.bin (and val.bin) in it")
    else:
        train_file = path
    if vocab_size is None:
        raise ValueError(
            f"--data: {train_file} holds pre-tokenized ids, and .bin files do not record their vocabulary; "
            "pass --vocab-size (the tokenizer's, e.g. 50257 for GPT-2)"
        )
    if vocab_size > _UINT32_VOCAB_LIMIT:
        raise ValueError(f"--vocab-size {vocab_size:,} is larger than uint32 token ids can hold (2**32)")
    dtype = torch.uint16 if vocab_size <= _UINT16_VOCAB_LIMIT else torch.uint32
    vocab_note = f"{_dtype_name(dtype)} ids, vocab {vocab_size:,}"

    val_file = train_file.with_name("val.bin")
    if train_file.name == "train.bin" and val_file.is_file():
        train = _map_tokens(train_file, dtype, vocab_size)
        val = _map_tokens(val_file, dtype, vocab_size)
        description = f"{train_file} ({train.numel():,} tokens) / {val_file} ({val.numel():,} tokens), {vocab_note}"
        return TokenData(train, val, vocab_size, description, str(train_file), str(val_file),
                         mapped_files=_identities(train_file, val_file))

    tokens = _map_tokens(train_file, dtype, vocab_size)
    train, val, train_source, val_source = _hold_out_tail(tokens, train_file, seq_len)
    description = (
        f"{train_file}: {tokens.numel():,} tokens, {train.numel():,} train / {val.numel():,} val (the tail), "
        f"{vocab_note}"
    )
    return TokenData(train, val, vocab_size, description, train_source, val_source,
                     mapped_files=_identities(train_file))


def _identities(*files: Path) -> tuple[tuple[str, tuple[int, int, int]], ...]:
    """(path, (size, inode, modification time in ns)) of each memory-mapped file."""
    return tuple((str(f), _identity(f)) for f in files)


def _identity(file: Path) -> tuple[int, int, int]:
    stat = os.stat(file)
    return stat.st_size, stat.st_ino, stat.st_mtime_ns


def _map_tokens(file: Path, dtype: torch.dtype, vocab_size: int) -> torch.Tensor:
    """Memory-map ``file`` as a 1-D tensor of ``dtype``; pages are read only when a batch touches them."""
    n_bytes = file.stat().st_size
    if n_bytes == 0:
        raise ValueError(f"--data: {file} is empty")
    width = dtype.itemsize
    if n_bytes % width:
        raise ValueError(
            f"--data: {file} is {n_bytes:,} bytes, not a multiple of {width}, the size of one "
            f"{_dtype_name(dtype)} token id used with --vocab-size {vocab_size:,}; "
            "is it the right file and the right --vocab-size?"
        )
    # shared=False maps the file privately and opens it read-only: a read-only dataset works, and
    # nothing we do can write to it (shared=True opens it for writing and may even grow it).
    tokens = torch.from_file(str(file), shared=False, size=n_bytes // width, dtype=dtype)
    check_token_ids(tokens, vocab_size, file)
    return tokens


def check_token_ids(tokens: torch.Tensor, vocab_size: int, file: str | os.PathLike,
                    chunk: int = _VALIDATION_CHUNK) -> None:
    """Every id in ``tokens`` (a file's memory map) is below ``vocab_size``, or ValueError naming the
    file, the first bad id and its offset. Reads the map ``chunk`` ids at a time (numpy's max works
    on uint16/uint32 where torch's does not), so a file larger than RAM is checked at disk speed."""
    if tokens.numel() == 0 or vocab_size >= 2 ** (8 * tokens.element_size()):
        return  # every id the dtype can hold is in the vocabulary (bytes with vocab 256)
    ids = tokens.numpy()
    for start in range(0, ids.size, chunk):
        piece = ids[start : start + chunk]
        if int(piece.max()) < vocab_size:
            continue
        index = start + int((piece >= vocab_size).argmax())
        raise ValueError(
            f"--data: {file} holds token id {int(ids[index]):,} at token offset {index:,} (byte offset "
            f"{index * tokens.element_size():,}), but --vocab-size is {vocab_size:,}: every id must be below it. "
            "Pass the tokenizer's vocabulary size, or regenerate the file"
        )


def _hold_out_tail(
    tokens: torch.Tensor, file: Path, seq_len: int | None
) -> tuple[torch.Tensor, torch.Tensor, str, str]:
    """Split one file's tokens into (train, val, train_source, val_source): val is the last 10%,
    or one sequence (seq_len + 1 tokens) if that is longer."""
    n_tokens = tokens.numel()
    n_val = n_tokens // _HELD_OUT_DIVISOR
    if seq_len is not None:
        n_val = min(n_tokens, max(n_val, seq_len + 1))
    n_train = n_tokens - n_val
    return (
        tokens[:n_train],
        tokens[n_train:],
        f"{file} (its first {n_train:,} tokens, the training part)",
        f"{file} (its last {n_val:,} tokens, held out for validation)",
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _byte_vocab_size(vocab_size: int | None, what: str) -> int:
    if vocab_size is None:
        return BYTE_VOCAB_SIZE
    if vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small for {what}: its tokens are bytes (ids 0-255), "
            f"so it needs at least {BYTE_VOCAB_SIZE}"
        )
    return vocab_size


def _require_positive(argument: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{argument} must be positive, got {value}")


def _require_batch_shape(batch_size: int, seq_len: int) -> None:
    _require_positive("--batch-size", batch_size)
    _require_positive("--seq-len", seq_len)


def _require_one_sequence(tokens: torch.Tensor, source: str, seq_len: int) -> None:
    # A sequence needs seq_len inputs plus one more token for the last target.
    if tokens.numel() < seq_len + 1:
        raise ValueError(
            f"--data: {source} has {tokens.numel():,} tokens, but --seq-len {seq_len:,} needs at least "
            f"{seq_len + 1:,} (the inputs plus one target token); use more data or a smaller --seq-len"
        )


def _seeded_generator(stream: str, *numbers: int) -> torch.Generator:
    """A generator whose seed is a hash of ``stream`` and ``numbers``: nearby keys (step 1 vs 2,
    rank 0 vs 1) get unrelated seeds, and the result is the same in every process and Python
    version (unlike ``hash()``, which is salted per process for strings)."""
    key = ":".join([stream, *(str(int(n)) for n in numbers)])  # int(): numpy/torch integers print differently
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return torch.Generator().manual_seed(seed)


def _cut_batch(
    tokens: torch.Tensor, source: str, vocab_size: int, batch_size: int, seq_len: int, generator: torch.Generator,
    document_starts: torch.Tensor | None, document_boundary: int | None,
) -> Batch:
    # Offsets up to numel - seq_len - 1 leave room for seq_len inputs and the one extra target.
    offsets = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
    # Slice, then widen each window to int64 on its own: a slice of a memory-mapped tensor touches
    # only its pages, and copying to int64 is among the few ops torch implements for uint16/uint32
    # (max, for one, is not).
    windows = torch.stack([tokens[offset : offset + seq_len + 1].to(torch.int64) for offset in offsets.tolist()])
    largest = int(windows.max())
    if largest >= vocab_size:
        raise ValueError(
            f"--data: {source} holds token id {largest:,}, but --vocab-size is {vocab_size:,} (ids must be "
            "below it); pass the tokenizer's vocabulary size"
        )
    inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if document_starts is not None:
        segment_starts = _starts_at_positions(document_starts, offsets.tolist(), seq_len)
    elif document_boundary is not None:
        segment_starts = inputs == document_boundary
    else:
        return Batch(inputs, targets)
    segment_starts[:, 0] = True  # every row begins a segment: none crosses rows
    cu_seqlens = torch.cat([segment_starts.flatten().nonzero().flatten(), torch.tensor([inputs.numel()])])
    return Batch(inputs, targets, cu_seqlens.to(torch.int32), int(cu_seqlens.diff().max()))


def _starts_at_positions(document_starts: torch.Tensor, offsets: list[int], seq_len: int) -> torch.Tensor:
    """(rows, seq_len) bool: True where a document of the sorted ``document_starts`` begins inside
    the inputs of the row cut at each offset."""
    starts = torch.zeros(len(offsets), seq_len, dtype=torch.bool)
    for row, offset in enumerate(offsets):
        first, end = torch.searchsorted(document_starts, torch.tensor([offset, offset + seq_len])).tolist()
        starts[row, document_starts[first:end] - offset] = True
    return starts
