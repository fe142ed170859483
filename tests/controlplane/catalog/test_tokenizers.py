"""A tier's tokenizer files: read from the model's directory, checked, stored, loaded by the
gateway to count prompts exactly."""

from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command

from controlplane.catalog.models import TierTokenizer
from controlplane.catalog.tokenizers import tier_tokenizer_publish
from controlplane.gateway import state
from workers.engines.cpu import tiny_model

pytestmark = pytest.mark.django_db


@pytest.fixture
def model_dir(tmp_path):
    tiny_model.build_tokenizer(tmp_path)  # tokenizer.json and tokenizer_config.json with its template
    return tmp_path


def test_the_node_agent_publishes_the_tokenizer_of_a_model_it_has_once(world, model_dir):
    world.vision.model_id = str(model_dir)
    world.vision.save()
    assert tier_tokenizer_publish(tier=world.vision, source="node gpu-a") is True
    assert tier_tokenizer_publish(tier=world.vision, source="node gpu-a") is False  # unchanged: kept
    stored = TierTokenizer.objects.get(tier=world.vision)
    assert stored.chat_template == tiny_model.CHAT_TEMPLATE and stored.special_tokens["eos_token"] == "<|im_end|>"


def test_a_model_this_node_does_not_have_publishes_nothing(world):
    assert tier_tokenizer_publish(tier=world.vision, source="node gpu-a") is False  # a hub id not in the cache
    assert not TierTokenizer.objects.exists()


def test_the_gateway_counts_with_the_tiers_tokenizer_once_it_is_stored(world, model_dir):
    call_command("tier_tokenizer", "--tier", "vlm-lite", str(model_dir))
    tiers = state._load_tiers()
    messages = [{"role": "user", "content": "hello world"}]
    layout = tiers["vlm-lite"].tokenizer.layout(messages, [], markers=2)
    assert layout.prompt_tokens == len(tiers["vlm-lite"].tokenizer.tokenizer.encode(
        tiers["vlm-lite"].tokenizer.render(messages), add_special_tokens=False).ids)
    assert tiers["text"].tokenizer is None  # no files: the estimate


def test_an_upload_without_a_chat_template_is_refused(world, model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(CommandError, match="no chat template"):
        call_command("tier_tokenizer", "--tier", "vlm-lite", str(model_dir))
