"""The soak: `specserve serve` under saturating mixed traffic for a bounded time, with pass/fail targets
(services.soak.main)."""
