"""Reading an operator's evaluation set from a file, row by row, refusing each bad row with
its number and the reason. Pure Python: no Django, no Celery.

Two layouts:
- JSONL: one object a line, {"image", "question", "answer" or "answers", "task_type"}, the
  image a path inside the zip the file came in, an http(s) URL, base64 or a data URL;
- VLMEvalKit's TSV: columns index, image (base64, or the index of a row whose image it
  shares), question, answer, optional hint and category, and A, B, C, ... for the choices of
  a multiple-choice question.
A file may come alone or in a zip with the images its rows name. Every image goes through
the gateway's own checks (format from the bytes, pixels from the header before decoding, the
decode within a CPU budget, no document smuggled inside), and URLs are fetched through
outbound.py's vetting.
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
import posixpath
import string
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from controlplane.benchmarks import presence
from controlplane.benchmarks.scoring import TASKS
from controlplane.imaging.decode import open_image, sniff_problem
from controlplane.imaging.errors import ImageError
from controlplane.imaging.policy import decode_data_url

FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 50_000_000
IMAGE_CPU_S = 2.0
MAX_QUESTION_CHARS = 4000
MAX_ANSWERS = 20
MAX_ANSWER_CHARS = 1000
MAX_ROWS = 20_000
MAX_ARCHIVE_BYTES = 4 * 1024 * 1024 * 1024  # what a zip's members may inflate to, in all
# VLMEvalKit's multiple-choice columns.
CHOICES = tuple(string.ascii_uppercase)


class FileRefused(ValueError):
    """The file as a whole cannot be read (not one bad row)."""


@dataclass(frozen=True)
class Draft:
    """A row that passed every check: an item ready to be saved."""

    row: int
    task_type: str
    question: str
    answers: list[str]
    content_type: str
    width: int
    height: int
    data: bytes
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RowError:
    row: int
    reason: str


class RowRefused(ValueError):
    pass


def checked_image(data: bytes) -> tuple[str, int, int]:
    """The content type, width and height of an image an evaluation set may hold; RowRefused
    with the gateway's reason otherwise (a decompression bomb, a polyglot, a truncated file)."""
    if len(data) > MAX_IMAGE_BYTES:
        raise RowRefused(f"image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB")
    try:
        sniff_problem(data)
        image = open_image(data, allowed_formats=tuple(FORMATS), max_input_pixels=MAX_IMAGE_PIXELS,
                           cpu_seconds=IMAGE_CPU_S, sniffed=True)
        with image:
            fmt, (width, height) = image.format, image.size
            image.load()  # the whole picture decodes, within its CPU time
    except ImageError as exc:
        raise RowRefused(f"image refused: {exc}") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise RowRefused(f"image refused: it does not decode ({exc})") from None
    return FORMATS["JPEG" if fmt == "MPO" else fmt], width, height


class Archive:
    """The images of a zip, by their path inside it; bounded as a zip bomb would not be."""

    def __init__(self, data: bytes | None):
        self.zip, self.base = None, ""
        if data is None:
            return
        try:
            self.zip = zipfile.ZipFile(io.BytesIO(data))
        except (zipfile.BadZipFile, OSError) as exc:
            raise FileRefused(f"not a zip file: {exc}") from None
        if sum(info.file_size for info in self.zip.infolist()) > MAX_ARCHIVE_BYTES:
            raise FileRefused("the zip inflates to more than 4 GB")
        self.names = {info.filename: info for info in self.zip.infolist() if not info.is_dir()}

    def table(self) -> tuple[str, bytes]:
        """The one .jsonl or .tsv file in the zip, with its name."""
        tables = [name for name in self.names if name.lower().endswith((".jsonl", ".tsv"))
                  and not posixpath.basename(name).startswith(".")]
        if len(tables) != 1:
            raise FileRefused(f"the zip must hold one .jsonl or .tsv file; it holds {len(tables)}")
        self.base = posixpath.dirname(tables[0])  # the rows' paths are from the table's folder
        return tables[0], self.read(tables[0], limit=MAX_ARCHIVE_BYTES)

    def find(self, path: str) -> str | None:
        """The member a row's `path` names: from the table's folder, else from the zip's root."""
        for name in (posixpath.normpath(posixpath.join(self.base, path)), posixpath.normpath(path)):
            if name in self.names:
                return name
        return None

    def read(self, name: str, *, limit: int = MAX_IMAGE_BYTES) -> bytes:
        info = self.names.get(name)
        if info is None:
            raise RowRefused(f"the zip holds no file {name!r}")
        if info.file_size > limit:
            raise RowRefused(f"{name!r} is larger than {limit // (1024 * 1024)} MB")
        try:
            with self.zip.open(info) as member:
                data = member.read(limit + 1)
        except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError) as exc:
            raise RowRefused(f"{name!r} cannot be read from the zip: {exc}") from None
        if len(data) > limit:
            raise RowRefused(f"{name!r} is larger than {limit // (1024 * 1024)} MB")
        return data


Fetch = Callable[[str], bytes]


def fetcher(client: httpx.Client, *, max_bytes: int = MAX_IMAGE_BYTES, timeout_s: float = 10.0) -> Fetch:
    """Fetch an image URL with `client` (outbound.client: vetted, no redirects), within
    `max_bytes` and `timeout_s`; RowRefused with the reason otherwise."""

    def fetch(url: str) -> bytes:
        try:
            with client.stream("GET", url, timeout=timeout_s, headers={"Accept": "image/*"}) as response:
                if response.status_code != 200:
                    raise RowRefused(f"image URL answered HTTP {response.status_code}")
                kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                if not kind.startswith("image/"):
                    raise RowRefused(f"image URL returned {kind or 'no content type'}, not an image")
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise RowRefused(f"image at URL is larger than {max_bytes // (1024 * 1024)} MB")
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.HTTPError as exc:
            raise RowRefused(f"image URL could not be fetched: {exc}") from None

    return fetch


def _no_fetch(url: str) -> bytes:
    raise RowRefused("image URLs are not fetched here")


def _image_bytes(value, archive: Archive, fetch: Fetch) -> bytes:
    if not isinstance(value, str) or not value.strip():
        raise RowRefused("image is missing")
    value = value.strip()
    if value.startswith("data:"):
        try:
            return decode_data_url(value, max_bytes=MAX_IMAGE_BYTES)
        except ImageError as exc:
            raise RowRefused(f"image data URL refused: {exc}") from None
    if value[:8].lower().startswith(("http://", "https://")):
        return fetch(value)
    if archive.zip is not None and not value.startswith("/") and (name := archive.find(value)):
        return archive.read(name)
    if len(value) <= 255 and "." in value[-6:]:
        raise RowRefused(f"image {value[:80]!r} is no file of the zip" if archive.zip is not None
                         else f"image {value[:80]!r} names a file, but no zip came with the images")
    return _base64(value)


def _base64(value: str) -> bytes:
    if len(value) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise RowRefused(f"image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB")
    try:
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError):
        raise RowRefused("image is neither a file of the zip, a URL, a data URL nor base64") from None


def _text(value, what: str, limit: int) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise RowRefused(f"{what} must be text")
    text = str(value).strip()
    if not text:
        raise RowRefused(f"{what} is empty")
    if len(text) > limit:
        raise RowRefused(f"{what} is longer than {limit} characters")
    if "\x00" in text:
        raise RowRefused(f"{what} holds a NUL character")
    return text


def _answers(row: dict) -> list[str]:
    if "answers" in row and row["answers"] is not None:
        values = row["answers"]
        if not isinstance(values, list):
            raise RowRefused("answers must be a list of accepted answers")
    elif "answer" in row and row["answer"] is not None:
        values = [row["answer"]]
    else:
        raise RowRefused("answer (or answers) is missing")
    if not values:
        raise RowRefused("answers is empty")
    if len(values) > MAX_ANSWERS:
        raise RowRefused(f"more than {MAX_ANSWERS} accepted answers")
    return [_text(v, "an answer", MAX_ANSWER_CHARS) for v in values]


def _task(value, default: str) -> str:
    task = default if value is None or value == "" else value
    if not isinstance(task, str) or task not in TASKS:
        raise RowRefused(f"task_type {str(task)[:40]!r} is not one of {', '.join(TASKS)}")
    return task


def _draft(row: int, task: str, question: str, answers: list[str], data: bytes, meta: dict) -> Draft:
    if task == "presence":
        try:
            answers = [presence.truth(answers)]
        except ValueError:
            raise RowRefused("a presence question's answer must be yes or no") from None
    content_type, width, height = checked_image(data)
    return Draft(row=row, task_type=task, question=question, answers=answers, content_type=content_type,
                 width=width, height=height, data=data, meta=meta)


def jsonl_rows(text: str, *, default_task: str, archive: Archive, fetch: Fetch
               ) -> tuple[int, Iterator[Draft | RowError]]:
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    return len(lines), _jsonl(lines, default_task, archive, fetch)


def _jsonl(lines, default_task: str, archive: Archive, fetch: Fetch) -> Iterator[Draft | RowError]:
    for number, line in lines:
        try:
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise RowRefused(f"not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise RowRefused("not a JSON object")
            question = _text(row.get("question"), "question", MAX_QUESTION_CHARS)
            answers = _answers(row)
            task = _task(row.get("task_type"), default_task)
            data = _image_bytes(row.get("image"), archive, fetch)
            meta = {k: row[k] for k in ("category", "id") if isinstance(row.get(k), str | int)}
            yield _draft(number, task, question, answers, data, meta)
        except RowRefused as exc:
            yield RowError(number, str(exc))


def _choices(record: dict) -> list[tuple[str, str]]:
    found = []
    for letter in CHOICES:
        value = (record.get(letter) or "").strip()
        if not value or value.lower() == "nan":
            break
        found.append((letter, value))
    return found


def tsv_rows(text: str, *, default_task: str, archive: Archive, fetch: Fetch
             ) -> tuple[int, Iterator[Draft | RowError]]:
    """VLMEvalKit's layout; a row's number is its line in a spreadsheet (the header is 1)."""
    csv.field_size_limit(sys.maxsize)
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter="\t")
    missing = {"index", "image", "question", "answer"} - set(reader.fieldnames or [])
    if missing:
        raise FileRefused(f"the TSV has no column {', '.join(sorted(missing))} (VLMEvalKit's layout: index, image, "
                          "question, answer, and A, B, C, ... for choices)")
    records = list(reader)
    return len(records), _tsv(records, default_task, archive, fetch)


def _tsv(records: list[dict], default_task: str, archive: Archive, fetch: Fetch) -> Iterator[Draft | RowError]:
    by_index = {(r.get("index") or "").strip(): r for r in records}
    for number, record in enumerate(records, 2):
        try:
            if None in record:
                raise RowRefused("more cells than columns")
            image = (record.get("image") or "").strip()
            if len(image) <= 64 and image in by_index and by_index[image] is not record:
                image = (by_index[image].get("image") or "").strip()  # the image of the row it names
            if image.startswith("["):
                raise RowRefused("several images for one question are not supported")
            question = _text(record.get("question"), "question", MAX_QUESTION_CHARS)
            answer = _text(record.get("answer"), "answer", MAX_ANSWER_CHARS)
            task = _task(record.get("task_type"), default_task)
            meta = {"index": (record.get("index") or "").strip()}
            if (record.get("category") or "").strip():
                meta["category"] = record["category"].strip()
            choices = _choices(record)
            answers = [answer]
            if choices:
                letters = dict(choices)
                if answer.upper() not in letters:
                    raise RowRefused(f"answer {answer[:20]!r} is not one of the choices {', '.join(letters)}")
                letter = answer.upper()
                answers = [letter, letters[letter], f"{letter}. {letters[letter]}"]
                hint = (record.get("hint") or "").strip()
                question = "\n".join([*([f"Hint: {hint}"] if hint and hint.lower() != "nan" else []),
                                      question, *(f"{k}. {v}" for k, v in choices),
                                      "Answer with the letter of the right choice."])
                meta["choices"] = letters
            data = _image_bytes(image, archive, fetch)
            yield _draft(number, task, question, answers, data, meta)
        except RowRefused as exc:
            yield RowError(number, str(exc))


def read_rows(data: bytes, file_name: str, *, default_task: str, fetch: Fetch | None = None
              ) -> tuple[int, Iterator[Draft | RowError]]:
    """How many rows an uploaded file (.jsonl, .tsv, or a .zip holding one with its images)
    has, and each of them checked as it is read: a Draft, or a RowError saying why not.
    FileRefused for a file that cannot be read at all."""
    if default_task not in TASKS:
        raise FileRefused(f"task type {default_task!r} is not one of {', '.join(TASKS)}")
    archive = Archive(None)
    name = file_name.lower()
    if name.endswith(".zip"):
        archive = Archive(data)
        file_name, data = archive.table()
        name = file_name.lower()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise FileRefused("the file is not UTF-8 text") from None
    reader = tsv_rows if name.endswith(".tsv") else jsonl_rows if name.endswith(".jsonl") else None
    if reader is None:
        raise FileRefused("the file must be .jsonl, .tsv, or a .zip holding one of them with its images")
    total, rows = reader(text, default_task=default_task, archive=archive, fetch=fetch or _no_fetch)
    if total > MAX_ROWS:
        raise FileRefused(f"the file has {total} rows; a set holds at most {MAX_ROWS}")
    if total == 0:
        raise FileRefused("the file has no rows")
    return total, rows
