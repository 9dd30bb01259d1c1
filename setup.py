"""One build step on top of pyproject.toml: the starter policy, the example tools and the
image build contexts live at the repository's root and ship inside the package as
``runner/_bundled/`` (``runner.examples_dir()``), copied as files, never as links."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUNDLED = ("policies.yaml", "tools", "tool_images")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")


class BuildWithExamples(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the repository's own copies
        target = Path(self.build_lib) / "runner" / "_bundled"
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for name in BUNDLED:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, target / name, ignore=IGNORED, symlinks=False)
            else:
                shutil.copyfile(source, target / name)


setup(cmdclass={"build_py": BuildWithExamples})
