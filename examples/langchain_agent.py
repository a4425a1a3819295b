"""An attention-explainer agent: LangChain's ``create_agent`` with any chat model named ``provider:model``.

    python examples/langchain_agent.py "Which heads collapse on 'The cat sat on the mat.', and does it matter?"
    python examples/langchain_agent.py --llm anthropic:claude-sonnet-4-5 --topic collapse --text "The cat sat."
    ATTENTION_EXPLAINER_LLM=ollama:llama3.1 python examples/langchain_agent.py "What does layer 3 head 0 read?"

The chat model is created by ``langchain.chat_models.init_chat_model``; it needs the provider's LangChain
package (``langchain-openai``, ``langchain-anthropic``, ...) and its API key. Without them the script says
what to install and set, and exits with code 2. The tools run locally on the bundled model either way.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any

from langchain.agents import create_agent
from langchain_core.messages import AIMessage

from agent_tools.loading import DEFAULT_MODEL
from agent_tools.prompts import TOPICS, explanation_template, system_prompt
from agent_tools.surfaces.langchain import AttentionToolkit

DEFAULT_LLM = "openai:gpt-4.1-mini"
LLM_ENV = "ATTENTION_EXPLAINER_LLM"
# provider -> (LangChain package, its import name, the API key variable or None for local providers)
PROVIDERS: dict[str, tuple[str, str, str | None]] = {
    "openai": ("langchain-openai", "langchain_openai", "OPENAI_API_KEY"),
    "anthropic": ("langchain-anthropic", "langchain_anthropic", "ANTHROPIC_API_KEY"),
    "google_genai": ("langchain-google-genai", "langchain_google_genai", "GOOGLE_API_KEY"),
    "mistralai": ("langchain-mistralai", "langchain_mistralai", "MISTRAL_API_KEY"),
    "groq": ("langchain-groq", "langchain_groq", "GROQ_API_KEY"),
    "deepseek": ("langchain-deepseek", "langchain_deepseek", "DEEPSEEK_API_KEY"),
    "xai": ("langchain-xai", "langchain_xai", "XAI_API_KEY"),
    "fireworks": ("langchain-fireworks", "langchain_fireworks", "FIREWORKS_API_KEY"),
    "together": ("langchain-together", "langchain_together", "TOGETHER_API_KEY"),
    "ollama": ("langchain-ollama", "langchain_ollama", None),
}
EXAMPLE_TEXT = "The cat sat on the mat because it was tired."


def missing_requirements(llm: str) -> list[str]:
    """What must be installed or set before ``init_chat_model(llm)`` can work (empty: nothing known missing)."""
    provider, sep, model = llm.partition(":")
    if not sep or not provider or not model:
        return [f"a chat model named provider:model (e.g. {DEFAULT_LLM}), got {llm!r}"]
    if provider not in PROVIDERS:
        return []  # init_chat_model knows more providers; let it say what it needs
    package, module, key = PROVIDERS[provider]
    needed = []
    if importlib.util.find_spec(module) is None:
        needed.append(f"the package {package} (pip install {package})")
    if key and not os.environ.get(key):
        needed.append(f"the environment variable {key} (your {provider} API key)")
    return needed


def build_agent(chat_model: Any, *, model: str = DEFAULT_MODEL, tools: Sequence[str] | None = None, **options: Any):
    """The agent: the toolkit's tools, and the system prompt listing exactly those tools."""
    toolkit = AttentionToolkit(model=model, tools=list(tools) if tools else None, **options)
    names = [tool.name for tool in toolkit.get_tools()]
    return create_agent(chat_model, toolkit.get_tools(), system_prompt=system_prompt(tools=names, default_model=model))


def ask(agent: Any, question: str) -> str:
    """Run the agent on one question; the final answer's text."""
    result = agent.invoke({"messages": [("user", question)]})
    return final_text(result)


def explain(agent: Any, topic: str, values: dict[str, Any], *, model: str = DEFAULT_MODEL) -> str:
    """Run the agent on one of the explanation templates (its human message; the agent has the system prompt)."""
    human = explanation_template(topic, default_model=model).invoke(values).to_messages()[-1]  # type: ignore[arg-type]
    return final_text(agent.invoke({"messages": [human]}))


def final_text(result: dict[str, Any]) -> str:
    last = result["messages"][-1]
    return last.text if isinstance(last, AIMessage) else str(last.content)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=f"Which heads collapse on {EXAMPLE_TEXT!r}, and does it matter?")
    parser.add_argument(
        "--llm", default=os.environ.get(LLM_ENV, DEFAULT_LLM), help="provider:model for init_chat_model"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the transformer to inspect (default: %(default)s)")
    parser.add_argument("--topic", choices=TOPICS, help="use an explanation template instead of the question")
    parser.add_argument("--text", default=EXAMPLE_TEXT, help="the text for --topic")
    args = parser.parse_args(argv)

    needed = missing_requirements(args.llm)
    if needed:
        print(f"To run this agent with {args.llm!r} you need: " + "; ".join(needed) + ".", file=sys.stderr)
        print(f"Choose another chat model with --llm provider:model or ${LLM_ENV}.", file=sys.stderr)
        return 2
    from langchain.chat_models import init_chat_model

    try:
        chat_model = init_chat_model(args.llm)
    except (ImportError, ValueError) as exc:
        print(f"Cannot create the chat model {args.llm!r}: {exc}", file=sys.stderr)
        return 2
    agent = build_agent(chat_model, model=args.model)
    if args.topic:
        values = {"text": args.text, "layer": 3, "head": 0, "prompt": args.text, "question": args.question}
        template = explanation_template(args.topic)
        print(explain(agent, args.topic, {k: values[k] for k in template.input_variables}, model=args.model))
    else:
        print(ask(agent, args.question))
    return 0


if __name__ == "__main__":
    sys.exit(main())
