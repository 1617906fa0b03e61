"""The names of the official ``mcp`` Python SDK (2.x, and the pydantic and anyio it brings)
that ``rfmem mcp`` uses, imported in one place: when the SDK cannot be imported, importing
this module (so any module of the MCP server, :mod:`rfmem_fast.serving.mcp_server` first)
raises ImportError with the command that installs it (``pip install "rfmem_fast[mcp]"``).
"""
from __future__ import annotations

try:
    import anyio
    from mcp.server.auth.middleware.auth_context import get_access_token
    from mcp.server.auth.provider import AccessToken
    from mcp.server.auth.settings import AuthSettings
    from mcp.server.mcpserver import MCPServer, ResourceSecurity
    from mcp.server.mcpserver.exceptions import ResourceNotFoundError, ToolError, UnexpectedToolError
    from mcp.types import Resource as MCPResource
    from mcp.types import ToolAnnotations
    from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
except ImportError as exc:  # pragma: no cover - depends on the environment
    from .._optional import install_hint

    raise ImportError(
        f"the MCP server (rfmem mcp) needs the official mcp SDK (2.x), which cannot be imported ({exc}); "
        f"install it with: {install_hint('mcp')}",
        name=exc.name,
    ) from exc

__all__ = [
    "AccessToken", "AuthSettings", "BaseModel", "BeforeValidator", "ConfigDict", "Field", "MCPResource", "MCPServer",
    "ResourceNotFoundError", "ResourceSecurity", "ToolAnnotations", "ToolError", "UnexpectedToolError",
    "ValidationError", "anyio", "get_access_token",
]
