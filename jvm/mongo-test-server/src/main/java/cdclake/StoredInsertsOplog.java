package cdclake;

import de.bwaldvogel.mongo.MongoBackend;
import de.bwaldvogel.mongo.MongoCollection;
import de.bwaldvogel.mongo.backend.Cursor;
import de.bwaldvogel.mongo.backend.ValueComparator;
import de.bwaldvogel.mongo.backend.aggregation.Aggregation;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.oplog.Oplog;
import java.util.Iterator;
import java.util.List;

/**
 * The library's oplog, with one correction: an insert is logged only when its document was stored.
 *
 * <p>mongo-java-server 1.47.0 logs every document of an insert command after the command ran, the ones it refused
 * included ({@code AbstractMongoDatabase.insertDocuments} calls {@code oplog.handleInsert} with the whole list,
 * whatever the write errors): a second insert of an {@code _id} refused with E11000, and the documents after it in
 * an ordered {@code insertMany} that were never tried, all got an oplog entry, so every change stream saw inserts
 * that never happened (seen in the demo on 2026-12-07: a refused insert of an older version of a document put that
 * version into its mirror). MongoDB logs only what it applied.
 *
 * <p>Contract: {@code handleInsert} passes on, in their order, only the documents that the collection holds under
 * their {@code _id} right after the command, equal by BSON comparison ({@link ValueComparator}) to the one inserted;
 * a refused duplicate (the collection holds the earlier document) and a document never tried (nothing under its
 * {@code _id}) are left out. Every other call goes to the library's oplog unchanged. One writer at a time, as the
 * test server is used: a concurrent update of the same document between the insert and this check would leave the
 * insert out (the update's own entry follows it).
 */
final class StoredInsertsOplog implements Oplog {
  private final Oplog delegate;
  private final MongoBackend backend;

  StoredInsertsOplog(Oplog delegate, MongoBackend backend) {
    this.delegate = delegate;
    this.backend = backend;
  }

  @Override
  public void handleInsert(String namespace, List<Document> documents) {
    int dot = namespace.indexOf('.');
    MongoCollection<?> collection =
        dot < 0
            ? null
            : backend.resolveDatabase(namespace.substring(0, dot))
                .resolveCollection(namespace.substring(dot + 1), false);
    if (collection == null) { // not a collection of a database (the library's own bookkeeping): as before
      delegate.handleInsert(namespace, documents);
      return;
    }
    List<Document> stored = documents.stream().filter(document -> isStored(collection, document)).toList();
    if (!stored.isEmpty()) {
      delegate.handleInsert(namespace, stored);
    }
  }

  private static boolean isStored(MongoCollection<?> collection, Document document) {
    Iterator<Document> found =
        collection.handleQuery(new Document("_id", document.get("_id")), 0, 1).iterator();
    return found.hasNext() && ValueComparator.asc().compare(found.next(), document) == 0;
  }

  @Override
  public void handleUpdate(
      String namespace, Document selector, Document query, List<Object> modifiedIds) {
    delegate.handleUpdate(namespace, selector, query, modifiedIds);
  }

  @Override
  public void handleDelete(String namespace, Document query, List<Object> deletedIds) {
    delegate.handleDelete(namespace, query, deletedIds);
  }

  @Override
  public void handleDropCollection(String namespace) {
    delegate.handleDropCollection(namespace);
  }

  @Override
  public Cursor createCursor(Document changeStreamDocument, String namespace, Aggregation aggregation) {
    return delegate.createCursor(changeStreamDocument, namespace, aggregation);
  }
}
