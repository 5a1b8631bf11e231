"""The one build step pyproject.toml cannot say: cli.py (the Typer app, beside pruneflow/ in the source tree) goes
into the wheel as pruneflow/cli.py, so it installs as ``pruneflow.cli``, not as a top-level ``cli`` module."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "pruneflow" / "cli.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        self.copy_file(str(Path(__file__).resolve().parent / "cli.py"), str(target))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / "pruneflow" / "cli.py")]


setup(cmdclass={"build_py": BuildPy})
