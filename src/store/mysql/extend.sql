CALL idempotency_keys_extend(?, ?, ?, ?)
