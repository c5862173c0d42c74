"""vLLM's extension fields of the OpenAI bodies that kvmesh does not implement (beam
search, structural tags, logits processors, ...): declared so that they are refused with a 400
naming the field unless they ask for nothing, as OpenAI's own unimplemented fields are
(``unsupported_fields.py``). A client written for vLLM that sends one would otherwise get an
answer silently other than it asked for. The extensions kvmesh serves (``top_k``, ``min_p``,
``truncate_prompt_tokens``, ``min_tokens``, ``repetition_penalty``, ``stop_token_ids``,
``include_stop_str_in_output``, ``ignore_eos``, ``skip_special_tokens``, ``cache_salt``,
``allowed_token_ids``, ``bad_words``, chat's ``add_generation_prompt`` /
``continue_final_message``) are the bodies' own fields (``generate_body.py``,
``protocol.py``), the structured outputs (``structured_outputs``, ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``) ``structured_body.py``'s; those that
ask for nothing whatever their value (``guided_decoding_backend``;
``spaces_between_special_tokens``, which fast tokenizers do not read) stay ignored extras.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field

from kvmesh.cluster.generate_body import Body
from kvmesh.cluster.unsupported_fields import Unsupported, is_empty, only, unsupported_doc


def _is_null(v: Any) -> bool:
    return v is None


def _is_false(v: Any) -> bool:
    return v is None or v is False


NULL_ONLY = only()
FALSE_ONLY = only({"const": False})
EMPTY_ARRAY = only({"type": "array", "maxItems": 0})
EMPTY_OBJECT = only({"type": "object", "maxProperties": 0})


def _doc(accepted: str) -> str:
    return unsupported_doc(accepted, " vLLM's extension.")


class VllmExtras(Body):
    """vLLM's extensions of both bodies that kvmesh does not implement."""

    VLLM_UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {
        "use_beam_search": Unsupported("beam search", "false", _is_false),
        "length_penalty": Unsupported(
            "length_penalty (beam search)", "1", lambda v: v is None or v == 1
        ),
        "logits_processors": Unsupported("logits processors", "[]", is_empty),
        "structural_tag": Unsupported("structural tags", "null", _is_null),
        "priority": Unsupported("priority scheduling", "0", lambda v: v is None or v == 0),
        "prompt_logprobs": Unsupported(
            "prompt_logprobs over HTTP (completions' echo with logprobs gives a prompt's)",
            "null",
            _is_null,
        ),
        "return_tokens_as_token_ids": Unsupported("return_tokens_as_token_ids", "false", _is_false),
        "kv_transfer_params": Unsupported(
            "kv_transfer_params (kvmesh moves KV between its workers itself)", "null", _is_null
        ),
        "vllm_xargs": Unsupported("vllm_xargs", "{}", is_empty),
    }

    use_beam_search: Annotated[bool | None, FALSE_ONLY] = Field(None, description=_doc("false"))
    length_penalty: Annotated[float | None, only({"const": 1})] = Field(None, description=_doc("1"))
    logits_processors: Annotated[list[Any] | None, EMPTY_ARRAY] = Field(
        None, description=_doc("[]")
    )
    structural_tag: Annotated[Any, NULL_ONLY] = Field(None, description=_doc("null"))
    priority: Annotated[int | None, only({"const": 0})] = Field(None, description=_doc("0"))
    prompt_logprobs: Annotated[int | None, NULL_ONLY] = Field(None, description=_doc("null"))
    return_tokens_as_token_ids: Annotated[bool | None, FALSE_ONLY] = Field(
        None, description=_doc("false")
    )
    kv_transfer_params: Annotated[dict[str, Any] | None, NULL_ONLY] = Field(
        None, description=_doc("null")
    )
    vllm_xargs: Annotated[dict[str, Any] | None, EMPTY_OBJECT] = Field(None, description=_doc("{}"))


class ChatVllmExtras(Body):
    """vLLM's extensions of the chat body that kvmesh does not implement."""

    VLLM_UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {
        "echo": Unsupported("echo in chat (completions' echo is served)", "false", _is_false),
        "chat_template": Unsupported(
            "a chat template in the request (the model's own is used)", "null", _is_null
        ),
        "chat_template_kwargs": Unsupported("chat_template_kwargs", "{}", is_empty),
        "documents": Unsupported("documents", "[]", is_empty),
        "mm_processor_kwargs": Unsupported("mm_processor_kwargs", "{}", is_empty),
        "add_special_tokens": Unsupported(
            "add_special_tokens in chat (the template has the special tokens)", "false", _is_false
        ),
    }

    echo: Annotated[bool | None, FALSE_ONLY] = Field(None, description=_doc("false"))
    chat_template: Annotated[str | None, NULL_ONLY] = Field(None, description=_doc("null"))
    chat_template_kwargs: Annotated[dict[str, Any] | None, EMPTY_OBJECT] = Field(
        None, description=_doc("{}")
    )
    documents: Annotated[list[Any] | None, EMPTY_ARRAY] = Field(None, description=_doc("[]"))
    mm_processor_kwargs: Annotated[dict[str, Any] | None, EMPTY_OBJECT] = Field(
        None, description=_doc("{}")
    )
    add_special_tokens: Annotated[bool | None, FALSE_ONLY] = Field(None, description=_doc("false"))
