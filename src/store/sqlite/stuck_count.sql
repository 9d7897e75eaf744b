SELECT COUNT(*)
FROM idempotency_keys
WHERE state = 'processing'
    AND created_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1
