SELECT id, from_state, from_retryable, to_state, to_retryable, lease_token, actor, reason, at
FROM idempotency_key_events
WHERE scope = ?
    AND `key` = ?
ORDER BY id
