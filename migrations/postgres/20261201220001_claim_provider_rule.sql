-- One provider per attempt that may have acted, and a provider key of its own for a re-created
-- key (docs/design.md, "One provider per attempt that may have acted" and "Provider keys").
--
-- The write of the claim takes a twelfth parameter, the provider key a re-created key sends (a key
-- whose earlier row was purged: its history is kept), and follows the provider rule:
-- * a takeover of an expired processing key needs the provider it recorded (the earlier attempt
--   may have acted there);
-- * a reclaim of failed{retryable} through another provider needs a key on which no attempt may
--   have acted, and records the new provider and provider key, so the sweeper asks the provider
--   that may act.
-- The replay branch of the claim statement (`replay!()` in src/store/postgres/sql.rs) states the same
-- rule on the row it reads.
DROP FUNCTION idempotency_keys_claim_write(text, text, text, text, text, text, text, text,
    bigint, bigint, bigint);

CREATE FUNCTION idempotency_keys_claim_write(
    p_scope text, p_key text, p_operation text, p_provider text, p_provider_key text,
    p_fingerprint text, p_request text, p_owner text, p_lease_ms bigint, p_retention_ms bigint,
    p_window_ms bigint, p_reused_provider_key text)
RETURNS idempotency_keys_claimed
LANGUAGE plpgsql AS $$
DECLARE
    r idempotency_keys_claimed;
BEGIN
    INSERT INTO idempotency_keys AS k (scope, key, operation, provider, provider_key, state,
        retryable, fingerprint, request, lease_token, lease_owner, lease_expires_at, attempts,
        created_at, updated_at, retention_ms, version, last_actor, last_reason,
        last_attempt_at, may_have_acted)
    VALUES (p_scope, p_key, p_operation, p_provider,
        CASE WHEN p_reused_provider_key IS NOT NULL AND EXISTS (SELECT 1
            FROM idempotency_key_events e WHERE e.scope = p_scope AND e.key = p_key)
        THEN p_reused_provider_key ELSE p_provider_key END,
        'processing', false, p_fingerprint, p_request,
        (extract(epoch from statement_timestamp()) * 1000000)::bigint, p_owner,
        statement_timestamp() + p_lease_ms * interval '1 millisecond', 1,
        statement_timestamp(), statement_timestamp(), p_retention_ms, 1, 'worker', 'claimed',
        statement_timestamp(), false)
    ON CONFLICT (scope, key) DO UPDATE SET
        state = 'processing', retryable = false,
        request = COALESCE(excluded.request, k.request),
        provider_key = CASE WHEN k.state = 'failed' AND k.provider IS DISTINCT FROM excluded.provider
            THEN excluded.provider_key ELSE k.provider_key END,
        provider = CASE WHEN k.state = 'failed' THEN excluded.provider ELSE k.provider END,
        lease_token = k.lease_token + 1, lease_owner = excluded.lease_owner,
        lease_expires_at = excluded.lease_expires_at, attempts = k.attempts + 1,
        updated_at = excluded.updated_at, expires_at = NULL, next_check_at = NULL,
        error = NULL, response_status = NULL, response_headers = NULL, response_body = NULL,
        retention_ms = excluded.retention_ms, version = k.version + 1, last_actor = 'worker',
        last_attempt_at = excluded.last_attempt_at,
        may_have_acted = CASE WHEN k.state = 'failed' THEN k.may_have_acted ELSE true END,
        last_reason = CASE WHEN k.state = 'failed'
            THEN 'reclaimed after a retryable failure'
            ELSE 'retry took over an expired lease' END
    WHERE COALESCE(k.fingerprint = p_fingerprint AND (
        (k.state = 'failed' AND k.retryable
            AND (k.provider IS NOT DISTINCT FROM p_provider OR NOT k.may_have_acted))
        OR (p_window_ms IS NOT NULL AND k.state = 'processing'
            AND k.provider IS NOT DISTINCT FROM p_provider
            AND k.lease_expires_at <= statement_timestamp()
            AND k.created_at > statement_timestamp() - p_window_ms * interval '1 millisecond')),
        false)
    RETURNING true, k.last_reason, k.scope, k.key, k.operation, k.provider, k.provider_key,
        k.state, k.retryable, k.fingerprint, k.request, k.response_status, k.response_headers,
        k.response_body, k.error, k.lease_token, k.lease_owner, k.lease_expires_at, k.attempts,
        k.created_at, k.updated_at, k.expires_at, k.next_check_at, k.retention_ms,
        k.last_attempt_at, k.may_have_acted, statement_timestamp()
    INTO r;
    RETURN r;
END
$$;
