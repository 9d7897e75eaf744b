UPDATE idempotency_keys
SET last_attempt_at = CAST(unixepoch('subsec') * 1000 AS INTEGER), may_have_acted = 1,
    updated_at = CAST(unixepoch('subsec') * 1000 AS INTEGER)
WHERE scope = ?1
    AND key = ?2
    AND state = 'processing'
    AND lease_token = ?3
