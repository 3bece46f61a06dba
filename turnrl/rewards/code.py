"""Code rewards: the fraction of given tests a reply's program passes, run in the sandbox.

Tests are Python statements, usually asserts (``assert add(2, 3) == 5``). Each runs after
the program, in the same namespace, in one sandboxed process; a test that raises or fails
counts as failed, and so does every test when the program itself fails, loops or is killed.

Reward hacking: the program runs in the same process as the test harness, so it could patch
the harness and print fake results. Tests of the form ``assert EXPR == LITERAL`` are therefore
not judged inside: the sandbox only reports ``repr(EXPR)``, and the comparison with the
literal, which never enters the sandbox, happens here. Write tests that way where it matters.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re

from turnrl.sandbox import Limits, Sandbox

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_MARK = "@@turnrl-test@@"

_HARNESS = f'''
import json, sys
tests = json.load(open("tests.json"))
space = {{"__name__": "__main__"}}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), space)
except BaseException as err:
    print("{_MARK}" + json.dumps({{"program": type(err).__name__ + ": " + str(err)}}))
    sys.exit(0)
for test in tests:
    try:
        if test["expr"] is not None:
            result = {{"value": repr(eval(test["expr"], space))}}
        else:
            exec(test["code"], space)
            result = {{"passed": True}}
    except BaseException as err:
        result = {{"error": type(err).__name__ + ": " + str(err)[:200]}}
    print("{_MARK}" + json.dumps(result), flush=True)
'''


def extract_code(completion: str) -> str:
    """The last fenced code block of the reply (```python ... ```), else the whole reply."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _split_test(test: str) -> dict:
    """{"expr": EXPR, "expected": LITERAL} for ``assert EXPR == LITERAL``; else the code."""
    try:
        tree = ast.parse(test.strip())
    except SyntaxError:
        return {"expr": None, "code": test}
    node = tree.body[0] if len(tree.body) == 1 else None
    if (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)
            and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq)):
        try:
            expected = ast.literal_eval(node.test.comparators[0])
        except ValueError:
            return {"expr": None, "code": test}
        return {"expr": ast.unparse(node.test.left), "expected": expected}
    return {"expr": None, "code": test}


def _passed(test: dict, result: dict) -> bool:
    if test["expr"] is None:
        return result.get("passed") is True
    if "value" not in result:
        return False
    try:
        return ast.literal_eval(result["value"]) == test["expected"]
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False


async def code_tests_async(completion: str, tests: list[str], sandbox: Sandbox | None = None,
                           ) -> float | None:
    """Fraction of ``tests`` passed by the reply's program; None when there are no tests."""
    if not tests:
        return None
    box = sandbox or Sandbox(limits=Limits(wall_s=5.0, cpu_s=5.0))
    split = [_split_test(t) for t in tests]
    sent = [{"expr": t["expr"], "code": t.get("code")} for t in split]  # no expected values
    result = await box.run(_HARNESS, files={"solution.py": extract_code(completion),
                                            "tests.json": json.dumps(sent)})
    reports = []
    for line in result.stdout.splitlines():
        if line.startswith(_MARK):
            try:
                reports.append(json.loads(line[len(_MARK):]))
            except ValueError:
                reports.append({})
    # fewer reports than tests when the program failed or was stopped: the rest failed
    passed = sum(_passed(t, r) for t, r in zip(split, reports, strict=False))
    return passed / len(tests)


def code_tests(completion: str, tests: list[str], sandbox: Sandbox | None = None) -> float | None:
    """``code_tests_async`` from synchronous code (not inside a running event loop: there,
    await ``code_tests_async``)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(code_tests_async(completion, tests, sandbox))
    raise RuntimeError("code_tests called inside a running event loop; "
                       "use `await code_tests_async(...)`")
