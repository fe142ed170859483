"""A tier's tokenizer files: read from a model directory, checked, and stored on the tier."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from controlplane.catalog.models import ModelTier, TierTokenizer
from controlplane.env import env_str
from controlplane.prompts import ChatTokenizer

log = logging.getLogger(__name__)


class TokenizerFilesError(ValueError):
    pass


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # tokenizer_config.json may spell a token as an AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_model_tokenizer(directory: Path) -> tuple[str, str, dict]:
    """(tokenizer.json, chat template, special tokens) of a model directory."""
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerFilesError(f"{directory} has no tokenizer.json (a fast tokenizer is needed)")
    config = {}
    if (directory / "tokenizer_config.json").is_file():
        config = json.loads((directory / "tokenizer_config.json").read_text())
    template = None
    for name in ("chat_template.jinja", "chat_template.json"):
        path = directory / name
        if path.is_file():
            text = path.read_text()
            template = json.loads(text).get("chat_template") if name.endswith(".json") else text
            break
    template = template or config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is what vLLM applies
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str) or not template.strip():
        raise TokenizerFilesError(f"{directory} has no chat template")
    special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
    return tokenizer_file.read_text(), template, {k: v for k, v in special.items() if v}


def model_directory(model_id: str) -> Path | None:
    """Where a model's files are on this host: a local path, or its Hugging Face cache."""
    path = Path(model_id)
    if path.is_dir():
        return path
    if "/" not in model_id:
        return None
    hf_home = env_str("HF_HOME", str(Path.home() / ".cache" / "huggingface"),
                      help="Hugging Face's home; the hub cache is `HF_HOME/hub` unless HF_HUB_CACHE says "
                           "otherwise. Default: `~/.cache/huggingface`.")
    cache = Path(env_str("HF_HUB_CACHE", str(Path(hf_home) / "hub"),
                         help="Where the node agent looks for a model named by hub id (its tokenizer "
                              "and chat template), as Hugging Face's libraries do. Default: "
                              "`HF_HOME/hub`."))
    snapshots = cache / f"models--{model_id.replace('/', '--')}" / "snapshots"
    found = sorted((p.parent for p in snapshots.glob("*/tokenizer.json")), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _digest(tokenizer_json: str, template: str, special: dict) -> str:
    return hashlib.sha256("\0".join([tokenizer_json, template, json.dumps(special, sort_keys=True)]).encode()).hexdigest()


def tier_tokenizer_store(*, tier: ModelTier, directory: Path, source: str) -> TierTokenizer:
    """Check the files make a working chat tokenizer, and keep them on the tier."""
    return _store(tier, directory, read_model_tokenizer(directory), source)


def _store(tier: ModelTier, directory: Path, files: tuple[str, str, dict], source: str) -> TierTokenizer:
    tokenizer_json, template, special = files
    try:
        ChatTokenizer(tokenizer_json, template, special=special).render([{"role": "user", "content": "hi"}])
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions for a broken file
        raise TokenizerFilesError(f"the tokenizer of {directory} does not work: {exc}") from None
    stored, _ = TierTokenizer.objects.update_or_create(tier=tier, defaults={
        "tokenizer_json": tokenizer_json, "chat_template": template, "special_tokens": special,
        "digest": _digest(*files), "source": source[:255]})
    return stored


def tier_tokenizer_publish(*, tier: ModelTier, source: str) -> bool:
    """From a node that has the tier's model: store its tokenizer unless the same is stored.
    Never fails a launch: a tier without a tokenizer keeps the gateway's estimate."""
    directory = model_directory(tier.model_id)
    if directory is None:
        return False
    try:
        files = read_model_tokenizer(directory)
        if TierTokenizer.objects.filter(tier=tier, digest=_digest(*files)).exists():
            return False
        _store(tier, directory, files, source)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer published for tier %s: %s", tier.name, exc)
        return False
    return True
