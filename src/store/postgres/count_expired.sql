SELECT count(*)
FROM idempotency_keys
WHERE state <> 'processing'
    AND expires_at <= statement_timestamp()
