UPDATE idempotency_keys
SET last_attempt_at = statement_timestamp(), may_have_acted = true,
    updated_at = statement_timestamp()
WHERE scope = $1::text
    AND key = $2::text
    AND state = 'processing'
    AND lease_token = $3::bigint
