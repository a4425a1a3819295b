"""Package list for setuptools (metadata is in pyproject.toml).

Every ``agent_tools*`` package from the source tree, plus ``agent_tools.prompt_files`` built from the
top-level ``prompts/`` folder, so the prompt files exist once in the repository and ship inside the wheel.
pyproject.toml cannot combine package discovery with a mapped extra package, hence this file.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["agent_tools", "agent_tools.*"]), "agent_tools.prompt_files"],
    package_dir={"agent_tools.prompt_files": "prompts"},
)
