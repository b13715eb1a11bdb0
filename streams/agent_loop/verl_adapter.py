"""Run verl's own agent-loop classes, unchanged, as Rollout Bus sessions.

verl's loops (``verl.experimental.agent_loop.*``) import on CPU when verl 0.9.1 and its
small imports are on the path (see ``tests/verl_compat/test_verl_loops.py`` for the list); then
``VerlAgentLoop`` builds the verl loop with what verl's ``AgentLoopWorker`` hands it — a
verl-shaped trainer config (``actor_rollout_ref.rollout`` and ``data`` as OmegaConf), the
server manager, tokenizer, processor, ``hf_model_type`` and the worker's tools — and runs
it. Register one in the agent-loop YAML::

    - name: verl_tool_agent
      _target_: rolloutbus.streams.agent_loop.verl_adapter.VerlAgentLoop
      verl_class: verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop
      hf_model_type: qwen3          # verl picks its Continuous Token builder by it

``VerlServerManager`` is verl's ``LLMServerClient.generate`` over our client (the session
recorder, so every turn is logged as for any loop). Tools are handed over in verl's types:
function tools as verl's ``FunctionTool``, other tools behind a proxy whose schema is
verl's ``OpenAIFunctionToolSchema``. verl is imported only when such a loop is built.
"""

from __future__ import annotations

from typing import Any

from rolloutbus.errors import AgentLoopError
from rolloutbus.schemas.agent_loop import AgentLoopOutput, TokenOutput
from rolloutbus.streams.agent_loop.base import AgentLoopBase, DictConfigWrap, ToolListWrap
from rolloutbus.streams.agent_loop.tool_parser import schema_dict
from rolloutbus.streams.agent_loop.tools import FunctionTool
from rolloutbus.streams.plugins import import_object

_VERL_ONLY_FIELDS = ("mm_processor_output",)  # verl's SGLang video payload: not stored here


class VerlServerManager:
    """verl's server-manager interface (``LLMServerClient.generate``) over our LLM client."""

    def __init__(self, client: Any):
        self._client = client

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        mm_processor_output: Any = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> TokenOutput:
        extra: dict[str, Any] = {}
        media = (("image_data", image_data), ("video_data", video_data), ("audio_data", audio_data))
        extra.update({key: value for key, value in media if value is not None})
        if mm_processor_kwargs:
            extra["mm_processor_kwargs"] = mm_processor_kwargs
        if priority:
            extra["priority"] = int(priority)  # verl forwards only a non-zero priority
        return await self._client.generate(
            request_id, prompt_ids=list(prompt_ids), sampling_params=dict(sampling_params), **extra
        )


class _VerlToolProxy:
    """One of our stateful tools, seen by verl's loop: verl's schema type, our life cycle."""

    def __init__(self, tool: Any, schema_cls: Any):
        self._tool = tool
        self.name = tool.name
        self.tool_schema = schema_cls.model_validate(schema_dict(tool.tool_schema))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tool, name)  # create / execute / calc_reward / release


def verl_tools(tools: list[Any]) -> list[Any]:
    """Our tools in verl's types (verl's ToolAgentLoop dispatches on ``isinstance``)."""
    # verl lives in a side environment, not in the project's venv (no stubs for mypy)
    from verl.tools.function_tool import (  # type: ignore[import-not-found]
        FunctionTool as VerlFunctionTool,
    )
    from verl.tools.schemas import OpenAIFunctionToolSchema  # type: ignore[import-not-found]

    out: list[Any] = []
    for tool in tools:
        if isinstance(tool, VerlFunctionTool):
            out.append(tool)  # already verl's
        elif isinstance(tool, FunctionTool):
            schema = OpenAIFunctionToolSchema.model_validate(schema_dict(tool.tool_schema))
            out.append(VerlFunctionTool(tool.name, tool.fn, schema, tool.is_async))
        elif isinstance(tool.tool_schema, OpenAIFunctionToolSchema):
            out.append(tool)  # a life-cycle tool whose schema is verl's already
        else:
            out.append(_VerlToolProxy(tool, OpenAIFunctionToolSchema))
    return out


def verl_trainer_config(config: Any) -> Any:
    """Our config as the OmegaConf tree verl's loops read (``actor_rollout_ref.rollout``,
    ``data``); keys verl has and we do not are absent, so a loop reading one fails loudly."""
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "actor_rollout_ref": {"rollout": config.rollout.model_dump(mode="json")},
            "data": config.data.model_dump(mode="json"),
        }
    )


class VerlAgentLoop(AgentLoopBase):
    """A verl agent-loop class (``verl_class``), built and run as verl's worker would."""

    def __init__(
        self,
        trainer_config: DictConfigWrap,
        server_manager: Any,
        tokenizer: Any,
        processor: Any = None,
        verl_class: str = "verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop",
        hf_model_type: str | None = None,
        tools: ToolListWrap | list[Any] | None = None,
        **kwargs: Any,
    ):
        super().__init__(trainer_config, server_manager, tokenizer, processor, **kwargs)
        try:
            from verl.experimental.agent_loop.agent_loop import (  # type: ignore[import-not-found]
                DictConfigWrap as VerlWrap,
            )
            from verl.experimental.agent_loop.agent_loop import (
                ToolListWrap as VerlToolList,
            )
        except ImportError as exc:
            raise AgentLoopError(
                f"verl's agent-loop modules do not import here ({exc}); install verl==0.9.1 "
                "and its imports (see tests/verl_compat/test_verl_loops.py) to run verl's own loops"
            ) from exc
        cls = import_object(verl_class, what="verl agent loop (verl_class)", kind="class")
        tool_list = tools.tools if isinstance(tools, ToolListWrap) else list(tools or [])
        verl_config = verl_trainer_config(self.config)
        self.verl_loop = cls(
            trainer_config=VerlWrap(config=verl_config),
            server_manager=VerlServerManager(server_manager),
            tokenizer=tokenizer,
            processor=processor,
            dataset_cls=self.dataset_cls,
            data_config=VerlWrap(verl_config.data),
            hf_model_type=hf_model_type,
            tools=VerlToolList(verl_tools(tool_list)),
            **self.extra_kwargs,
        )

    async def run(
        self, sampling_params: dict[str, Any], **kwargs: Any
    ) -> AgentLoopOutput | list[AgentLoopOutput]:
        result = await self.verl_loop.run(dict(sampling_params), **kwargs)
        if isinstance(result, list):
            return [as_our_output(output) for output in result]
        return as_our_output(result)


def as_our_output(output: Any) -> AgentLoopOutput:
    """verl's ``AgentLoopOutput`` as ours (the same fields; verl's SGLang payload dropped)."""
    data = output.model_dump(exclude=set(_VERL_ONLY_FIELDS))
    return AgentLoopOutput.model_validate(data)
