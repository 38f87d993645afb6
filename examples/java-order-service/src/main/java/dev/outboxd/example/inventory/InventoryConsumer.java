package dev.outboxd.example.inventory;

import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Statement;
import java.time.Duration;
import java.time.Instant;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.UUID;

import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.StringDeserializer;

import tools.jackson.databind.JsonNode;
import tools.jackson.databind.json.JsonMapper;

/**
 * The inventory service's consumer of the order events, with plain kafka-clients and JDBC (no Spring). For each
 * record it applies the event's effect and records the event in its inbox ({@code consumed_event}) in one
 * transaction of its own database, and commits the Kafka offsets only after that transaction committed (at
 * most every {@code --commit-interval-ms}). A record delivered again (outboxd delivers at least once; this
 * consumer may die between its database commits and its offset commit) finds its inbox row and changes
 * nothing: every effect is applied once.
 *
 * <p>Effects: {@code OrderConfirmed} reserves each line's quantity ({@code reservation} rows, {@code
 * stock.reserved}); {@code OrderCancelled} releases what the order holds. Other events are only recorded.
 *
 * <p>Inbox retention ({@code --inbox-retention-hours}, off by default): rows consumed longer ago are pruned, a few
 * thousand per statement at each offset commit. The retention must outlive every copy of an event the consumer
 * could still read: the topic's {@code retention.ms}, plus the time an {@code outboxd audit --heal} or {@code
 * outboxd replay} may republish it. An event created before the horizon whose id the inbox lacks may have been
 * applied before its row was pruned: it is reported ({@code beyond-retention TYPE EVENT_ID}) and not applied.
 *
 * <p>Prints one line per record ({@code applied TYPE EVENT_ID}, {@code duplicate TYPE EVENT_ID} or {@code
 * beyond-retention TYPE EVENT_ID}) after its transaction committed, and a JSON summary when it exits after {@code
 * --idle-exit-secs} without a record.
 *
 * <pre>
 * java -Dloader.main=dev.outboxd.example.inventory.InventoryConsumer \
 *      -cp target/order-service.jar org.springframework.boot.loader.launch.PropertiesLauncher \
 *      --brokers 127.0.0.1:9092 --database-url 'jdbc:postgresql://127.0.0.1:5432/inventory?user=postgres' \
 *      [--topic outbox.Order] [--group inventory] [--instance-id ID] [--commit-interval-ms 1000]
 *      [--idle-exit-secs 0 (never)] [--inbox-retention-hours 0 (off)]
 * </pre>
 */
public final class InventoryConsumer {
    private static final String SCHEMA = """
            CREATE TABLE IF NOT EXISTS consumed_event (
                consumer_name text NOT NULL,
                event_id      uuid NOT NULL,
                consumed_at   timestamptz NOT NULL DEFAULT now(),
                PRIMARY KEY (consumer_name, event_id));
            CREATE TABLE IF NOT EXISTS stock (
                sku      text PRIMARY KEY,
                reserved integer NOT NULL DEFAULT 0);
            -- No unique key on purpose: an effect applied twice would show as two rows.
            CREATE TABLE IF NOT EXISTS reservation (
                order_id    uuid NOT NULL,
                sku         text NOT NULL,
                quantity    integer NOT NULL,
                event_id    uuid NOT NULL,
                released_by uuid);
            """;

    private final Connection db;
    private final String consumerName;
    /** Zero: the inbox keeps every row. */
    private final Duration inboxRetention;
    private final JsonMapper json = JsonMapper.builder().build();
    private long applied;
    private long duplicates;
    private long beyondRetention;

    private InventoryConsumer(Connection db, String consumerName, Duration inboxRetention) {
        this.db = db;
        this.consumerName = consumerName;
        this.inboxRetention = inboxRetention;
    }

    public static void main(String[] argv) throws Exception {
        Map<String, String> args = flags(argv);
        String brokers = args.getOrDefault("brokers", "127.0.0.1:9092");
        String databaseUrl = require(args, "database-url");
        String topic = args.getOrDefault("topic", "outbox.Order");
        String group = args.getOrDefault("group", "inventory");
        // A stable id per replica (static membership): a restarted consumer takes its partitions back at once
        // instead of waiting for the group to notice the old one is gone.
        String instanceId = args.get("instance-id");
        Duration commitInterval = Duration.ofMillis(Long.parseLong(args.getOrDefault("commit-interval-ms", "1000")));
        Duration idleExit = Duration.ofSeconds(Long.parseLong(args.getOrDefault("idle-exit-secs", "0")));
        Duration inboxRetention = Duration.ofHours(Long.parseLong(args.getOrDefault("inbox-retention-hours", "0")));

        Properties config = new Properties();
        config.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, brokers);
        config.put(ConsumerConfig.GROUP_ID_CONFIG, group);
        if (instanceId != null) {
            config.put(ConsumerConfig.GROUP_INSTANCE_ID_CONFIG, instanceId);
        }
        config.put(ConsumerConfig.SESSION_TIMEOUT_MS_CONFIG, "10000");
        config.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        config.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        // Never a record of an aborted Kafka transaction (outboxd's --delivery exactly-once).
        config.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");
        config.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());
        config.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());

        try (Connection db = DriverManager.getConnection(databaseUrl);
                KafkaConsumer<String, String> kafka = new KafkaConsumer<>(config)) {
            try (Statement ddl = db.createStatement()) {
                ddl.execute(SCHEMA);
            }
            db.setAutoCommit(false);
            InventoryConsumer consumer = new InventoryConsumer(db, group, inboxRetention);
            kafka.subscribe(List.of(topic));
            Instant lastRecord = Instant.now();
            Instant lastCommit = Instant.now();
            boolean uncommitted = false;
            while (idleExit.isZero() || Duration.between(lastRecord, Instant.now()).compareTo(idleExit) < 0) {
                ConsumerRecords<String, String> records = kafka.poll(Duration.ofMillis(200));
                if (!records.isEmpty()) {
                    lastRecord = Instant.now();
                    for (ConsumerRecord<String, String> record : records) {
                        consumer.handle(record);
                    }
                    uncommitted = true;
                }
                // The offsets of handled records only (every record polled so far is), once their
                // transactions committed, and at most every --commit-interval-ms (one round trip per interval,
                // not per batch): a crash before this re-delivers what was handled since the last commit,
                // and the inbox absorbs it.
                if (uncommitted && Duration.between(lastCommit, Instant.now()).compareTo(commitInterval) >= 0) {
                    kafka.commitSync();
                    lastCommit = Instant.now();
                    uncommitted = false;
                    consumer.pruneInbox();
                }
            }
            if (uncommitted) {
                kafka.commitSync();
            }
            System.out.printf("{\"applied\": %d, \"duplicates\": %d, \"beyond_retention\": %d}%n",
                    consumer.applied, consumer.duplicates, consumer.beyondRetention);
        }
    }

    /** One record: inbox row and effect in one transaction. */
    private void handle(ConsumerRecord<String, String> record) throws SQLException {
        String eventId = header(record, "event_id");
        String eventType = header(record, "event_type");
        if (eventId == null || eventType == null) {
            System.err.printf("skipping %s-%d@%d: no event_id or event_type header%n",
                    record.topic(), record.partition(), record.offset());
            return;
        }
        UUID id = UUID.fromString(eventId);
        try {
            boolean first = recordInInbox(id);
            if (first && beforeRetention(header(record, "created_at"))) {
                // Its inbox row may have been pruned after it was applied: never apply it blindly again.
                db.rollback();
                beyondRetention++;
                System.out.printf("beyond-retention %s %s%n", eventType, eventId);
                return;
            }
            if (first) {
                JsonNode payload = json.readTree(record.value());
                switch (eventType) {
                    case "OrderConfirmed" -> reserve(id, payload);
                    case "OrderCancelled" -> release(id, payload);
                    default -> { }
                }
            }
            db.commit();
            if (first) {
                applied++;
            } else {
                duplicates++;
            }
            System.out.printf("%s %s %s%n", first ? "applied" : "duplicate", eventType, eventId);
        } catch (SQLException | RuntimeException e) {
            db.rollback();
            throw e;
        }
    }

    /** Whether an event created at {@code createdAt} (RFC 3339; none: unknown) is older than the inbox keeps. */
    private boolean beforeRetention(String createdAt) {
        if (inboxRetention.isZero() || createdAt == null) {
            return false;
        }
        return java.time.OffsetDateTime.parse(createdAt).toInstant().isBefore(Instant.now().minus(inboxRetention));
    }

    /** Deletes this consumer's inbox rows consumed before the retention, 5,000 per statement (short locks). */
    private void pruneInbox() throws SQLException {
        if (inboxRetention.isZero()) {
            return;
        }
        try (PreparedStatement prune = db.prepareStatement("""
                DELETE FROM consumed_event WHERE (consumer_name, event_id) IN (
                    SELECT consumer_name, event_id FROM consumed_event
                     WHERE consumer_name = ? AND consumed_at < now() - make_interval(secs => ?)
                     LIMIT 5000)""")) {
            prune.setString(1, consumerName);
            prune.setDouble(2, inboxRetention.toSeconds());
            int deleted;
            do {
                deleted = prune.executeUpdate();
                db.commit();
            } while (deleted == 5000);
        }
    }

    private boolean recordInInbox(UUID eventId) throws SQLException {
        try (PreparedStatement insert = db.prepareStatement(
                "INSERT INTO consumed_event (consumer_name, event_id) VALUES (?, ?) ON CONFLICT DO NOTHING")) {
            insert.setString(1, consumerName);
            insert.setObject(2, eventId);
            return insert.executeUpdate() == 1;
        }
    }

    private void reserve(UUID eventId, JsonNode payload) throws SQLException {
        UUID orderId = UUID.fromString(payload.get("orderId").asString());
        try (PreparedStatement reservation = db.prepareStatement(
                        "INSERT INTO reservation (order_id, sku, quantity, event_id) VALUES (?, ?, ?, ?)");
                PreparedStatement stock = db.prepareStatement("""
                        INSERT INTO stock (sku, reserved) VALUES (?, ?)
                        ON CONFLICT (sku) DO UPDATE SET reserved = stock.reserved + excluded.reserved""")) {
            for (JsonNode line : payload.get("lines")) {
                String sku = line.get("sku").asString();
                int quantity = line.get("quantity").asInt();
                reservation.setObject(1, orderId);
                reservation.setString(2, sku);
                reservation.setInt(3, quantity);
                reservation.setObject(4, eventId);
                reservation.executeUpdate();
                stock.setString(1, sku);
                stock.setInt(2, quantity);
                stock.executeUpdate();
            }
        }
    }

    private void release(UUID eventId, JsonNode payload) throws SQLException {
        UUID orderId = UUID.fromString(payload.get("orderId").asString());
        try (PreparedStatement released = db.prepareStatement("""
                        UPDATE reservation SET released_by = ? WHERE order_id = ? AND released_by IS NULL
                        RETURNING sku, quantity""");
                PreparedStatement stock = db.prepareStatement(
                        "UPDATE stock SET reserved = reserved - ? WHERE sku = ?")) {
            released.setObject(1, eventId);
            released.setObject(2, orderId);
            try (ResultSet rows = released.executeQuery()) {
                while (rows.next()) {
                    stock.setInt(1, rows.getInt(2));
                    stock.setString(2, rows.getString(1));
                    stock.executeUpdate();
                }
            }
        }
    }

    private static String header(ConsumerRecord<?, ?> record, String key) {
        Header header = record.headers().lastHeader(key);
        return header == null ? null : new String(header.value(), StandardCharsets.UTF_8);
    }

    private static Map<String, String> flags(String[] argv) {
        Map<String, String> flags = new HashMap<>();
        for (int i = 0; i < argv.length; i++) {
            if (!argv[i].startsWith("--") || i + 1 == argv.length) {
                throw new IllegalArgumentException("expected --name value pairs, got " + argv[i]
                        + " (see the class comment for the flags)");
            }
            flags.put(argv[i].substring(2), argv[++i]);
        }
        return flags;
    }

    private static String require(Map<String, String> args, String name) {
        String value = args.get(name);
        if (value == null) {
            throw new IllegalArgumentException("--" + name + " is required");
        }
        return value;
    }
}
