"""The built-in tool environment: the model calls Python functions by writing tool calls.

    env:
      name: tools                       # this class (regen.envs.tools:ToolEnv)
      args:
        tools: [my_module:search, python]   # functions; `python` is the sandboxed code tool
        timeout_s: 5

Each function becomes a JSON-schema tool spec (OpenAI / Hugging Face format: name, description
from the docstring's first paragraph, parameters from the signature's annotations), which the chat
template shows the model (`tools=`) where data.chat_template is on. A turn's tool calls are parsed
from its text, by default in the Hermes / Qwen form

    <tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call>

and each result is the next observation: a `tool` message (the chat template wraps it, e.g. in
<tool_response>), or `response_format` text for a model without a chat template. A turn without
a tool call is the model's final answer and ends the episode. Whatever goes wrong on the tool
side — a call that is not valid JSON, an unknown tool, wrong arguments, a function that raises or
runs past timeout_s — is an error observation the model reads, never a crashed or hung run: each
call runs in a forked child process that is killed at its timeout (isolate: true, the default).
"""

from __future__ import annotations

import inspect
import json
import multiprocessing
import re
import time
import typing
from collections.abc import Callable

from regen.envs import Environment, Step, import_object
from regen.errors import ConfigError

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class ToolCallError(ValueError):
    """A tool call the model wrote that cannot be run; its message is what the model reads."""


def parse_hermes(text: str) -> list[tuple[str, dict]]:
    """The (name, arguments) of each <tool_call>{json}</tool_call> in a turn, in order; [] when the
    turn has none. Raises ToolCallError for a call that is not {"name": str, "arguments": object}."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ToolCallError('a tool call must be a JSON object {"name": ..., "arguments": {...}}')
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ToolCallError(f"the arguments of '{call['name']}' are not a JSON object") from None
        if not isinstance(args, dict):
            raise ToolCallError(f"the arguments of '{call['name']}' must be a JSON object")
        calls.append((call["name"], args))
    if not calls and "<tool_call>" in text:  # opened and never closed: the model meant to call
        raise ToolCallError("the tool call is not closed with </tool_call>")
    return calls


def tool_spec(fn: Callable, name: str | None = None) -> dict:
    """The JSON-schema spec of a Python function: parameters from its annotations (str, int, float,
    bool, list, dict; others are strings), required = those without a default, descriptions from
    the docstring's first paragraph and its `name: text` lines under Args:."""
    doc = inspect.getdoc(fn) or ""
    summary = " ".join(doc.split("\n\n")[0].split()) or (name or fn.__name__)
    arg_docs = dict(re.findall(r"^\s*(\w+)(?: \([^)]*\))?:\s*(.+)$", doc.partition("Args:")[2], re.M))
    props, required = {}, []
    try:  # resolved: a module with `from __future__ import annotations` keeps them as strings
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001  (an annotation that does not resolve: described as a string)
        hints = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop = {"type": JSON_TYPES.get(hints.get(p.name, p.annotation), "string")}
        if p.name in arg_docs:
            prop["description"] = arg_docs[p.name]
        props[p.name] = prop
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    return {"type": "function", "function": {"name": name or fn.__name__, "description": summary,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


def load_tools(specs, sandbox: dict | None = None) -> dict[str, Callable]:
    """name -> function, from "module:function" strings (the function's name is the tool's) or
    {name: "module:function"}; `python` is the sandboxed code tool (regen/envs/sandbox.py)."""
    items = specs.items() if isinstance(specs, dict) else [(None, s) for s in specs]
    tools = {}
    for name, spec in items:
        if spec == "python":
            from regen.envs.sandbox import SandboxLimits, python_tool

            fn = python_tool(SandboxLimits(**(sandbox or {})))
            fn.sandboxed = True  # its own process with its own limits: not forked again (see call_tool)
        else:
            if not isinstance(spec, str) or ":" not in spec:
                raise ConfigError(f"env.args.tools: '{spec}' is not 'module:function' (or 'python')")
            fn = import_object(spec, "env.args.tools")
            if not callable(fn):
                raise ConfigError(f"env.args.tools: '{spec}' is not a function")
        tools[name or getattr(fn, "tool_name", None) or fn.__name__] = fn
    if not tools:
        raise ConfigError("env.args.tools: no tools given")
    return tools


def _child(conn, fn, args) -> None:
    try:
        conn.send((True, str(fn(**args))))
    except BaseException as e:  # noqa: BLE001  (anything the tool raises is the model's to read)
        conn.send((False, f"{type(e).__name__}: {e}"))
    conn.close()


def call_tool(fn: Callable, args: dict, timeout_s: float, isolate: bool = True) -> tuple[bool, str]:
    """(ok, text) of one call. isolate: in a forked child killed at timeout_s (a tool that hangs
    costs timeout_s, never the run); else in this process (fast, trusted tools only)."""
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as e:
        return False, f"bad arguments: {e}"
    if not isolate:
        try:
            return True, str(fn(**args))
        except Exception as e:  # noqa: BLE001
            return False, f"{type(e).__name__}: {e}"
    ctx = multiprocessing.get_context("fork")  # the tool is already imported here; a spawn would import it again
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args), daemon=True)
    proc.start()
    send.close()
    try:
        if recv.poll(timeout_s):
            try:
                return recv.recv()
            except EOFError:
                return False, f"the tool's process died (exit code {proc.exitcode})"
        return False, f"timed out after {timeout_s:g} s"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()


class ToolEnv(Environment):
    """Runs the functions the model calls; the episode ends with a turn that calls none."""

    def __init__(self, tools, timeout_s: float = 5.0, parser: str = "hermes", isolate: bool = True,
                 max_calls: int = 4, response_format: str = "<tool_response>{result}</tool_response>",
                 sandbox: dict | None = None):
        self.fns = load_tools(tools, sandbox)
        self.tools = [tool_spec(fn, name) for name, fn in self.fns.items()]
        self.parse = parse_hermes if parser == "hermes" else import_object(parser, "env.args.parser")
        self.timeout_s, self.isolate, self.max_calls, self.format = timeout_s, isolate, max_calls, response_format

    def reset(self, row, seed: int):
        return None  # the row's own prompt (rendered with the tools where data.chat_template is on)

    def step(self, turn: str) -> Step:
        try:
            calls = self.parse(turn)
        except ToolCallError as e:
            return self._answer([f"error: {e}"], 1, 1, 0.0)
        if not calls:
            return Step(None, done=True)
        results, errors, seconds, by_tool = [], 0, 0.0, {}
        for name, args in calls[: self.max_calls]:
            t0 = time.perf_counter()
            if name not in self.fns:
                ok, text = False, f"unknown tool '{name}'; tools: {', '.join(self.fns)}"
            else:
                fn = self.fns[name]
                ok, text = call_tool(fn, args, self.timeout_s, self.isolate and not getattr(fn, "sandboxed", False))
            dt = time.perf_counter() - t0
            seconds += dt
            if name in self.fns:  # per-tool latency (an unknown name is not a tool: no entry of its own)
                n, t = by_tool.get(name, (0, 0.0))
                by_tool[name] = (n + 1, t + dt)
            errors += not ok
            results.append(text if ok else f"error: {text}")
        if len(calls) > self.max_calls:
            results.append(f"error: at most {self.max_calls} tool calls per turn; the rest were not run")
            errors += 1
        return self._answer(results, len(calls), errors, seconds, by_tool)

    def _answer(self, results: list[str], calls: int, errors: int, seconds: float, by_tool=None) -> Step:
        msgs = [{"role": "tool", "content": r} for r in results]
        for m in msgs:
            m["text"] = self.format.format(result=m["content"])  # the form without a chat template
        return Step(msgs, info={"tool_calls": calls, "tool_errors": errors, "tool_seconds": seconds,
                                "tool_time": by_tool or {}})
