DELETE
FROM idempotency_keys
WHERE state <> 'processing'
    AND (scope, `key`) IN
