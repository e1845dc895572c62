"""umbp_nvme: asyncio KV-cache page store on local NVMe."""
