CALL idempotency_keys_extend_v1(?, ?, ?, ?)
