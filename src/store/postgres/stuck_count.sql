SELECT count(*)
FROM idempotency_keys
WHERE state = 'processing'
    AND created_at <= statement_timestamp() - $1::bigint * interval '1 millisecond'
