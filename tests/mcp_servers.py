"""MCP servers the tests start (stdio, by a worker; streamable HTTP, by the test): the real SDK's
``MCPServer``. Every real execution of a tool is appended to the file named by MCP_TEST_EFFECTS, outside
the system under test. Tools named in the file MCP_TEST_HIDDEN (one per line) are not offered: a server
whose tool list changed between a crash and the takeover.

    python mcp_servers.py docs|crm|broken stdio
    python mcp_servers.py docs|crm http PORT
"""

from __future__ import annotations

import json
import os
import sys
import time

import anyio
from mcp.server.lowlevel import Server
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_PARAMS, CallToolResult, ListToolsResult, TextContent, Tool, ToolAnnotations

READ = ToolAnnotations(read_only_hint=True)
DESTRUCTIVE = ToolAnnotations(destructive_hint=True)
IDEMPOTENT = ToolAnnotations(idempotent_hint=True, destructive_hint=False)


def record(tool: str, **args: object) -> None:
    path = os.environ.get("MCP_TEST_EFFECTS")
    if path:
        with open(path, "a") as f:  # O_APPEND: one short line is written whole
            f.write(json.dumps({"tool": tool, "pid": os.getpid(), **args}) + "\n")


def hidden() -> set[str]:
    path = os.environ.get("MCP_TEST_HIDDEN", "")
    return set(open(path).read().split()) if path and os.path.exists(path) else set()


def docs_server() -> MCPServer:
    server = MCPServer("docs", log_level="WARNING")

    @server.tool(annotations=READ)
    def search_docs(query: str, limit: int = 3) -> str:
        """Search the product documentation."""
        record("search_docs", query=query)
        return f"{limit} pages about {query}: setup, billing, limits"

    @server.tool(annotations=READ)
    def slow_search(query: str, seconds: float) -> str:
        """Search slowly."""
        record("slow_search", query=query)
        time.sleep(seconds)
        return f"slow results for {query}"

    def held_search(query: str, gate: str) -> str:
        """Search once the test opens the gate (a file named ``gate`` in MCP_TEST_GATES)."""
        record("held_search_started", query=query, gate=gate)
        path = os.path.join(os.environ.get("MCP_TEST_GATES", "/nonexistent"), gate)
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        record("held_search", query=query, gate=gate)
        return f"held results for {query}"

    if "held_search" not in hidden():
        server.tool(annotations=READ)(held_search)
    return server


def crm_server() -> MCPServer:
    server = MCPServer("crm", log_level="WARNING")
    gone = hidden()

    def offered(fn):
        return fn if fn.__name__ in gone else server.tool(annotations=ANNOTATIONS[fn.__name__])(fn)

    def delete_customer(customer: str) -> str:
        """Delete a customer and everything about them."""
        record("delete_customer", customer=customer)
        return f"deleted {customer}"

    def tag_customer(customer: str, tag: str, idempotency_key: str) -> str:
        """Tag a customer (idempotent per key)."""
        record("tag_customer", customer=customer, key=idempotency_key)
        return f"tagged {customer} {tag}"

    def set_tier(customer: str, tier: str) -> str:
        """Set a customer's tier: setting the same tier again changes nothing."""
        record("set_tier", customer=customer, tier=tier)
        return f"{customer} is {tier}"

    def refund(customer: str, amount_cents: int) -> str:
        """Refund a customer. Has no annotations: unsafe."""
        record("refund", customer=customer, amount_cents=amount_cents)
        return f"refunded {amount_cents}"

    def held_delete(customer: str, gate: str) -> str:
        """Delete a customer once the test opens the gate (a file named ``gate`` in MCP_TEST_GATES)."""
        record("held_delete_started", customer=customer)
        path = os.path.join(os.environ.get("MCP_TEST_GATES", "/nonexistent"), gate)
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        record("held_delete", customer=customer)
        return f"deleted {customer}"

    def failing_export(customer: str) -> str:
        """Export a customer; always fails."""
        record("failing_export", customer=customer)
        raise ToolError("export backend is down")

    def charge(customer: str, amount_cents: int) -> str:
        """Charge a customer; the server dies after the charge, before it answers (as in a crash)."""
        record("charge", customer=customer, amount_cents=amount_cents)
        os._exit(1)

    def strict_refund(customer: str, amount_cents: int) -> str:
        """Refund a positive amount: anything else is refused with a JSON-RPC error reply (INVALID_PARAMS)."""
        record("strict_refund", customer=customer, amount_cents=amount_cents)
        if amount_cents <= 0:
            raise MCPError(INVALID_PARAMS, f"amount_cents must be positive, got {amount_cents}")
        return f"refunded {amount_cents}"

    for fn in (delete_customer, tag_customer, set_tier, refund, held_delete, failing_export, charge, strict_refund):
        offered(fn)
    return server


def broken_server() -> Server:
    """A server whose one tool has a schema with a $ref to nothing (jsonschema cannot resolve it)."""
    schema = {"type": "object", "properties": {"q": {"$ref": "#/$defs/Query"}}, "required": ["q"]}

    async def list_tools(ctx: object, params: object) -> ListToolsResult:
        return ListToolsResult(
            tools=[Tool(name="lookup", description="Look up.", input_schema=schema, annotations=READ)]
        )

    async def call_tool(ctx: object, params: object) -> CallToolResult:
        record("lookup")
        return CallToolResult(content=[TextContent(type="text", text="found")])

    return Server("broken", on_list_tools=list_tools, on_call_tool=call_tool)


def run_lowlevel_stdio(server: Server) -> None:
    async def main() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)


ANNOTATIONS = {
    "delete_customer": DESTRUCTIVE,
    "tag_customer": IDEMPOTENT,
    "set_tier": IDEMPOTENT,
    "refund": None,
    "held_delete": DESTRUCTIVE,
    "failing_export": DESTRUCTIVE,
    "charge": None,
    "strict_refund": None,
}


if __name__ == "__main__":
    kind, transport = sys.argv[1], sys.argv[2]
    if kind == "broken":
        run_lowlevel_stdio(broken_server())
        sys.exit()
    server = docs_server() if kind == "docs" else crm_server()
    if transport == "stdio":
        server.run()
    else:
        server.run("streamable-http", port=int(sys.argv[3]))
