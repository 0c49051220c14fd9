"""A plain Python agent with a calculator tool, written against the official ``openai`` client
and nothing else: the program asyncrl trains through its gateway (docs/gateway.md).

It knows nothing of asyncrl. Given a question, it asks the model, runs the ``calc`` tool
whenever the model calls it, hands back the result, and returns the model's final answer::

    answer = await solve(client, [{"role": "user", "content": "12+345+67"}])

Two ways to run it:

* **managed** (the gateway starts it once per session, ``[gateway] agent = ["python",
  "gateway_calc/calc_agent.py"]`` in ``examples/tiny_gateway_calc.toml``: paths from the
  config file's directory, ``python`` the run's interpreter): ``OPENAI_BASE_URL`` and
  ``OPENAI_API_KEY`` are set for it, the prompt comes on stdin as JSON; it prints its answer
  and exits 0, and the run's environment scores the answer.
* **as a service** (``--service runs/tiny-gateway-calc/gateway.json``): one process runs many
  sessions at once, each taken from the gateway with the admin key (``POST /rl/sessions``),
  solved with :func:`solve`, and ended with the reward this program computes
  (``POST /rl/sessions/<id>/reward``); it stops when the run ends. The way to train an agent
  that already runs as a service of yours: point its ``base_url`` at each session's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Add and subtract integers, e.g. 12+345+67.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12+345+67"}},
            "required": ["expression"],
        },
    },
}
MAX_TURNS = 4


def calc(expression: str) -> str:
    """The tool: the value of a sum or difference of integers (``12+345-67``), or what is
    wrong with it (in words the tiny model's vocabulary has)."""
    text = expression.replace(" ", "")
    if not re.fullmatch(r"-?\d{1,30}([+-]\d{1,30}){0,20}", text):
        return "error: not a sum"
    return str(sum(int(n) for n in re.findall(r"[+-]?\d+", text)))


async def solve(client: openai.AsyncOpenAI, messages: list[dict[str, Any]]) -> tuple[str, bool]:
    """Ask until the model answers without a tool call; the answer, and whether it called."""
    messages = list(messages)
    called = False
    answer = ""
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(
            model="tiny", messages=messages, tools=[CALC], max_tokens=24
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        answer = message.content or ""
        if not message.tool_calls:
            break
        called = True
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments or "{}")
            result = calc(str(arguments.get("expression", "")))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return answer, called


# ---------------------------------------------------------------------------------- managed
async def managed() -> int:
    prompt = json.loads(sys.stdin.readline())
    async with openai.AsyncOpenAI(max_retries=0) as client:  # OPENAI_BASE_URL, OPENAI_API_KEY
        answer, _ = await solve(client, prompt["messages"])
    print(answer)
    return 0


# ---------------------------------------------------------------------------------- service
async def serve(info_path: Path, concurrency: int) -> int:
    """Run sessions until the run ends; the rewards are this program's (right or wrong)."""
    info = await _gateway(info_path)
    url, key = info["url"], Path(info["key_file"]).read_text().strip()
    admin = {"Authorization": f"Bearer {key}"}
    done = {"sessions": 0, "right": 0, "called": 0}
    started = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency * 2)

    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def worker() -> None:
            while True:
                try:
                    r = await http.post(f"{url}/rl/sessions", headers=admin, json={"wait_s": 5})
                except httpx.TransportError:
                    return  # the run is over
                if r.status_code == 503:
                    if r.json()["error"]["code"] == "run_ending":
                        return
                    continue
                r.raise_for_status()
                session = r.json()
                client = openai.AsyncOpenAI(base_url=session["base_url"],
                                            api_key=session["api_key"], http_client=http,
                                            max_retries=0)  # fmt: skip
                question = session["prompt"]["messages"][-1]["content"]
                try:
                    answer, called = await solve(client, session["prompt"]["messages"])
                except openai.APIConnectionError:
                    return
                except openai.APIStatusError:
                    continue  # the session ended under it (the run stopped, a limit hit)
                right = answer.strip() == str(calc(question))
                done["sessions"] += 1
                done["right"] += right
                done["called"] += called
                reward = {"reward": float(right), "correct": right,
                          "rewards": {"exact": float(right), "tool_call": float(called)}}  # fmt: skip
                try:
                    await http.post(f"{url}/rl/sessions/{session['session_id']}/reward",
                                    headers=admin, json=reward)  # fmt: skip
                except httpx.TransportError:
                    return

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    n = max(done["sessions"], 1)
    print(f"calc_agent: {done['sessions']} sessions in {time.monotonic() - started:.0f} s, "
          f"right {done['right'] / n:.3f}, tool calls {done['called'] / n:.3f}")  # fmt: skip
    return 0


async def _gateway(path: Path) -> dict[str, Any]:
    """The gateway's ``gateway.json`` once a live run has written it (a file a killed run
    left behind names a process that is gone: wait for the new one)."""
    while True:
        try:
            info = json.loads(path.read_text())
            os.kill(info["pid"], 0)
            return info
        except (OSError, ValueError, KeyError):
            await asyncio.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--service", type=Path, metavar="GATEWAY_JSON",
                        help="run sessions from this gateway until its run ends")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=128)
    args = parser.parse_args()
    if args.service is not None:
        return asyncio.run(serve(args.service, args.concurrency))
    if not os.environ.get("OPENAI_BASE_URL"):
        parser.error("set OPENAI_BASE_URL and OPENAI_API_KEY (the gateway does), or give --service")
    return asyncio.run(managed())


if __name__ == "__main__":
    sys.exit(main())
