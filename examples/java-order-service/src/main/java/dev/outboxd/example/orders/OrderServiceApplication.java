package dev.outboxd.example.orders;

import org.springframework.boot.SpringApplication;
import org.springframework.boot.autoconfigure.SpringBootApplication;

/**
 * The order service of the Transactional Outbox pattern: every change of an order and the event that tells the
 * world about it commit in one database transaction ({@link OrderService}); outboxd takes the events from
 * {@code outbox_event} to Kafka. The service never talks to Kafka.
 */
@SpringBootApplication
public class OrderServiceApplication {
    public static void main(String[] args) {
        SpringApplication.run(OrderServiceApplication.class, args);
    }
}
