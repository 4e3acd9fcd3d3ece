import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


# Every subpackage of hororing is found, not listed; kernels/ sits at the top level of the
# repository but installs as hororing.kernels, so the name ``kernels`` is never taken.
PACKAGES = find_packages(include=["hororing", "hororing.*"]) + [
    "hororing.kernels" + package[len("kernels"):] for package in find_packages(include=["kernels", "kernels.*"])]

# The opt-in 'import horovod' alias (hororing/alias.py) is started by a .pth file at the top
# of site-packages, which Python reads at start-up: it does nothing unless HORORING_AS_HOROVOD
# is set. An editable install gets it from scripts/install.sh.
ALIAS_PTH = "hororing-horovod-alias.pth"


class BuildWithAlias(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(os.path.join("hororing", "horovod-alias.pth"),
                           os.path.join(self.build_lib, ALIAS_PTH))

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [os.path.join(self.build_lib, ALIAS_PTH)]


setup(
    name="hororing",
    version="0.1.0",
    description="A pip-installable, Horovod-compatible ring-allreduce data-parallel library over MPI",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=PACKAGES,
    package_dir={"hororing.kernels": "kernels"},
    cmdclass={"build_py": BuildWithAlias},
    entry_points={"console_scripts": ["hororun = hororing.launcher:main"]},
    # numba: the ring's compiled steps (hororing/algorithms/compiled/); without it the
    # Python steps run
    install_requires=["numpy>=1.22", "mpi4py>=3.1", "cloudpickle>=2", "ml_dtypes>=0.3",
                      "threadpoolctl>=3",
                      "numba>=0.59; platform_python_implementation == 'CPython'"],
    extras_require={
        "mpi": ["mpich"],
        "torch": ["torch>=2.1"],
        # the CPU build where PyPI has one (Linux x86_64), TensorFlow's own package elsewhere
        "tensorflow": ["tensorflow-cpu>=2.16; platform_system == 'Linux' and "
                       "platform_machine == 'x86_64'",
                       "tensorflow>=2.16; platform_system != 'Linux' or "
                       "platform_machine != 'x86_64'"],
        "cuda": ["cupy>=13", "numba>=0.59"],
        "test": ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout>=2", "hypothesis>=6",
                 "scikit-learn>=1.0", "numba>=0.59", "pyflakes>=3"],
        "bench": ["matplotlib>=3.5"],
    },
)
