"""Prompt files of attention-explainer (data, not code).

This folder is installed as the package ``agent_tools.prompt_files`` (see ``setup.py``: one copy, here).
Load the prompts through :mod:`agent_tools.prompts`, which fills in the tool list from the declarations.
"""
