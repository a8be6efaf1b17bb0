"""What both deployments' rollout workers share: the sampling settings, the LoRA adapter's sync, and the tools,
environment and agent of a multi-turn run."""

from __future__ import annotations

from hybrid_rl.config import Config, ConfigError
from hybrid_rl.rollout.agentic import AgentSetup
from hybrid_rl.rollout.chat_template import TemplateError, TemplateFamily, ToolSuffix, family_of
from hybrid_rl.rollout.multi_turn import ToolLoop, TurnLimits
from hybrid_rl.rollout.sampling import SamplingSettings
from hybrid_rl.rollout.tool_calls import get_parser
from hybrid_rl.rollout.tools import ToolRunner, load_environment, resolve_tools
from hybrid_rl.sidecar.black_box import load_agent


def sampling_settings(cfg: Config) -> SamplingSettings:
    r = cfg.rollout
    return SamplingSettings(r.max_new_tokens, r.temperature, r.top_p, r.top_k, r.speculative != "off")


def uses_tools(cfg: Config) -> bool:
    return bool(cfg.rollout.tools or cfg.rollout.environment)


def tool_schemas(cfg: Config) -> list[dict]:
    env = load_environment(cfg.rollout.environment) if cfg.rollout.environment else None
    return [t.schema for t in resolve_tools(list(cfg.rollout.tools))] + (list(env.schemas) if env else [])


def agent_setup(cfg: Config, tokenizer) -> AgentSetup:
    """The tools, environment and chat-template rules of a multi-turn run (ConfigError for any bad one). The tool
    workers start at the first call."""
    r, m = cfg.rollout, cfg.rollout.multi_turn
    try:
        tools = resolve_tools(list(r.tools))
        env = load_environment(r.environment) if r.environment else None
        family = family_of(m.template, getattr(tokenizer, "chat_template", None))
        schemas = [t.schema for t in tools] + (list(env.schemas) if env else [])
        suffix = ToolSuffix(tokenizer, family, schemas, user_turns=bool(env and env.has_respond))
        parser = get_parser(family.parser if m.parser == "auto" else m.parser)
    except (ValueError, TemplateError) as e:
        raise ConfigError(str(e)) from None
    runner = ToolRunner(tools, env.handlers if env else (), workers=m.tool_workers,
                        timeout_s=m.tool_timeout_s, max_chars=m.max_tool_response_tokens * 16)
    limits = TurnLimits(m.max_turns, m.max_tool_calls, m.max_tool_response_tokens, r.max_new_tokens, m.max_turn_tokens)
    return AgentSetup(ToolLoop(tokenizer, suffix, parser, runner, limits), runner, suffix, env,
                      cfg.data.max_prompt_tokens, m.schedule)


def black_box_family(cfg: Config, tokenizer) -> TemplateFamily:
    """A black-box agent run's chat-template family (its suffix rule), checked with the agent's import path."""
    try:
        load_agent(cfg.rollout.agent)
        family = family_of(cfg.rollout.multi_turn.template, getattr(tokenizer, "chat_template", None))
        ToolSuffix(tokenizer, family)
    except (ValueError, TemplateError) as e:
        raise ConfigError(str(e)) from None
    return family


def adapter_sync(cfg: Config) -> bool:
    """A LoRA actor whose adapter goes to vLLM by itself (`model.lora.sync=adapter`)."""
    return cfg.model.lora.rank > 0 and cfg.model.lora.sync == "adapter"

