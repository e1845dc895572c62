"""umbp_nvme: an asyncio key -> object store for LLM KV-cache pages on local NVMe."""
