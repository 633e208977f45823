"""fleetllm's version.

`fleetllm` is a namespace package (no `__init__.py`): its subpackages live in the top-level
folders engine/, operator/ and router/, and a folder named `operator` must never be a regular
package, or it would shadow the standard library's `operator` module whenever the repository
root is on `sys.path` (`python -m ...` run there).
"""

__version__ = "0.1.0"
