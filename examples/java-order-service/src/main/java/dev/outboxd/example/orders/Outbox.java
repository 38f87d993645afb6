package dev.outboxd.example.orders;

import java.util.Map;
import java.util.UUID;

import org.springframework.jdbc.core.namedparam.NamedParameterJdbcTemplate;
import org.springframework.stereotype.Component;
import org.springframework.transaction.annotation.Propagation;
import org.springframework.transaction.annotation.Transactional;

import tools.jackson.databind.ObjectMapper;

/**
 * Writes an event into the outbox table, the pattern's reference schema ({@code outboxd migrate} creates it).
 * It must run inside the caller's transaction ({@link Propagation#MANDATORY}): an event written on its own
 * could be published for a change that then rolled back.
 */
@Component
public class Outbox {
    private static final String INSERT = """
            INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
            VALUES (:eventId, :aggregateType, :aggregateId, :eventType, CAST(:payload AS jsonb))""";

    private final NamedParameterJdbcTemplate jdbc;
    private final ObjectMapper json;

    public Outbox(NamedParameterJdbcTemplate jdbc, ObjectMapper json) {
        this.jdbc = jdbc;
        this.json = json;
    }

    /** Adds the event to the current transaction; returns its id (the Kafka record's event_id header). */
    @Transactional(propagation = Propagation.MANDATORY)
    public UUID emit(String aggregateType, String aggregateId, String eventType, Object payload) {
        UUID eventId = UUID.randomUUID();
        jdbc.update(INSERT, Map.of(
                "eventId", eventId,
                "aggregateType", aggregateType,
                "aggregateId", aggregateId,
                "eventType", eventType,
                "payload", json.writeValueAsString(payload)));
        return eventId;
    }
}
