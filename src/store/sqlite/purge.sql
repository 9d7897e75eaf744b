DELETE
FROM idempotency_keys
WHERE (scope, key) IN ( SELECT scope,
    key FROM idempotency_keys WHERE state <> 'processing'
    AND expires_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER) ORDER BY expires_at LIMIT ?1)
